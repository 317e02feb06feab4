"""The RL algorithms of ``skip run``: verl's policy losses and advantage estimators behind the
trainer's registration hooks (``contract.py``), the loss aggregation they share, KL penalties, and
verl's on-policy distillation (``distillation.py``)."""
