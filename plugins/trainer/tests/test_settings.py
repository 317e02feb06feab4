"""Default torch threads per worker: never more threads at once than the pools' CPUs."""

import pytest
from skip_plugin_trainer.settings import Resources


@pytest.mark.parametrize("workers", [1, 2])
def test_default_threads_add_up_to_the_pools_cpus_whatever_runs_at_once(workers):
    resources = Resources.model_validate({"rollout": {"workers": workers, "cpus_per_worker": 1}, "actor": {"cpus": 2}})
    cpus = workers + 2
    # sync: the rollout workers generate together, then the actor trains alone
    assert resources.threads(1, overlapped=False, together=workers) == cpus // workers
    assert resources.threads(2, overlapped=False) == cpus
    # overlapped: every worker runs at once, each on its own CPUs
    assert workers * resources.threads(1, overlapped=True, together=workers) + resources.threads(2, True) == cpus


def test_torch_threads_wins():
    resources = Resources.model_validate({"torch_threads": 3})
    assert resources.threads(1, overlapped=False, together=2) == resources.threads(1, overlapped=True) == 3
