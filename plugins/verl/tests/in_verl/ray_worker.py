"""verl's trainer in a Ray worker process (as verl's ``TaskRunner`` runs it): the worker imports
verl, and the bridge armed at its interpreter's start-up serves the manager. The driver never
imports verl. Prints JSON. Usage: python ray_worker.py DUMP_DIR
"""

import json
import os
import sys
from pathlib import Path

import ray


@ray.remote
def train_one_step(dump_dir: str) -> dict:
    import skip_core
    from verl.experimental.agent_loop.agent_loop import AgentLoopManager
    from verl.utils.skip import SkipManager

    from conftest import ScriptedWorker, prompts, run_config

    worker = ScriptedWorker()
    manager = object.__new__(AgentLoopManager)
    manager.agent_loop_workers = [worker]
    SkipManager.init(run_config(Path(dump_dir)))
    SkipManager.set_step(1)
    manager.generate_sequences(prompts())
    manager.generate_sequences(prompts())
    skip_core.SkipManager.flush()
    served_by = getattr(SkipManager, "served_by", None)
    return {"served_by": served_by, "runs": len(worker.batches), "worker_pid": os.getpid()}


here = str(Path(__file__).resolve().parent)
ray.init(num_cpus=1, include_dashboard=False, log_to_driver=False, runtime_env={"env_vars": {"PYTHONPATH": here}})
try:
    report = ray.get(train_one_step.remote(sys.argv[1]), timeout=240)
finally:
    ray.shutdown()
report.update(driver_pid=os.getpid(), driver_imported_verl="verl" in sys.modules)
print(json.dumps(report))
