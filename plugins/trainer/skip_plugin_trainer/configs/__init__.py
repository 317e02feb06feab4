"""The Hydra configs of ``skip run`` (``run.yaml``) and ``skip rollout`` (``rollout.yaml``), shipped
with the trainer so the commands work from any directory. ``--config-dir`` puts a user's directory
in front of them: a ``run.yaml`` there replaces ours, and a config of another name can include
ours (``defaults: [run, _self_]``)."""
