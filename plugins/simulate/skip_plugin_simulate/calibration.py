"""The calibration check's prediction: a CPU run of skip's own trainer, simulated from its profile.

One shared definition for ``benchmarks/bench_simulate.py`` (which measures the runs) and the
test that holds the simulator to a recorded measurement.
"""

from __future__ import annotations

from skip_plugin_simulate.measured import Measured
from skip_plugin_simulate.simulate import simulate_all

SCHEDULES = ("sync", "one_step_off", "fully_async")
#: skip run at its default resources: a one-CPU rollout pool and a one-CPU actor pool, disjoint
#: under every schedule (sync takes turns on them).
CPU_RUN = ["cluster.devices=2", "cluster.rollout_devices=1", "cluster.colocated=false"]


def predict_steps(measured: Measured, steps: int, overrides: list[str] | None = None) -> dict[str, float]:
    """The mean step time each schedule is predicted to take on the profiled run's shape."""
    _, timelines = simulate_all({}, [*CPU_RUN, f"trainer.total_training_steps={steps}", *(overrides or [])],
                                list(SCHEDULES), measured)  # fmt: skip
    return {name: sum(row["timing_s/step"] for row in t.rows) / len(t.rows) for name, t in timelines.items()}
