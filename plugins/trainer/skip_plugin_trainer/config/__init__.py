"""The trainer's configuration, in one place: the Hydra configs of ``skip run`` (``run.yaml``) and
``skip rollout`` (``rollout.yaml``), which hold only what differs from the typed defaults; the
typed sections they are validated into once (``sections.py``, ``algorithm.py``); the settings
the commands pass down (``settings.py``); verl's keys and where each lands (``verl_keys.py``,
``verl_tables.py``, ``verl_defaults.py``); the checks that span keys (``memory_keys.py``,
``steps.py``); and what the settings decide: where the workers go (``placement.py``) and how
weights reach the engines (``weight_sync.py``).

The YAML ships with the trainer so the commands work from any directory. ``--config-dir`` puts a
user's directory in front of it: a ``run.yaml`` there replaces ours, and a config of another name
can include ours (``defaults: [run, _self_]``)."""
