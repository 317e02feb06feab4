"""``in_verl/`` runs inside a venv with verl 0.9.1, started by ``test_inside_verl.py``: not collected here."""

collect_ignore = ["in_verl"]
