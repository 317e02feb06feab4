"""``skip diff A B``: two runs or two skip caches compared step by step and phase by phase
(``compare``), printed as tables (``report``) by the command (``cli``); runs and caches are read as
hostile (``sources``). Nothing is imported here: ``skip`` registers the command on every start."""
