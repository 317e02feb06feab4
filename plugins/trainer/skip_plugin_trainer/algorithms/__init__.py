"""The RL algorithms of ``skip run``: verl's policy losses and advantage estimators behind the
trainer's registration hooks (``contract.py``), the loss aggregation they share, and KL penalties."""
