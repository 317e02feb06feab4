"""The three failures measured with verl 0.9.1's own SkipManager, through verl's decorated
``AgentLoopManager.generate_sequences``: a truncated dump, a planted pickle, and
``trainer.experiment_name=../../../escaped``. Prints what happened, as JSON, on its last line.

Run by test_bridge.py with the bridge on, and off (``SKIP_PLUGINS`` without skip-plugin-verl).
Usage: python verl_failures.py FRESH_DIRECTORY
"""

import json
import sys
import warnings
from pathlib import Path

from verl.experimental.agent_loop.agent_loop import AgentLoopManager
from verl.utils.skip import SkipManager

from conftest import SHAPE, ScriptedWorker, plant_verl_dump, prompts, run_config

root = Path(sys.argv[1])
served_by = getattr(SkipManager, "served_by", None)
worker = ScriptedWorker()
manager = object.__new__(AgentLoopManager)
manager.agent_loop_workers = [worker]
report: dict = {"served_by": served_by}


def flush() -> None:
    """skip dumps in the background (the next lookup waits for them); verl writes before returning."""
    if served_by:
        import skip_core

        skip_core.SkipManager.flush()


def call(step: int) -> str:
    SkipManager.set_step(step)
    before = len(worker.batches)
    try:
        manager.generate_sequences(prompts())
    except Exception as exc:
        return f"raised {type(exc).__name__}: {exc}"
    return "regenerated" if len(worker.batches) > before else "loaded"


dumps = root / "dumps"
step_dir = dumps / "exp_proj" / SHAPE
SkipManager.init(run_config(dumps))

# 1. A dump cut short, as a crash or a full disk leaves it.
call(1)
flush()
report["formats"] = sorted(path.name for path in (step_dir / "1").iterdir())
for path in (step_dir / "1").iterdir():
    if path.name != "meta.json":
        path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    report["truncated"] = call(1)
report["truncated_warning"] = " | ".join(str(w.message) for w in caught)

# 2. A pickle someone put where verl looks for step 2.
marker = root / "pwned"
plant_verl_dump(step_dir / "2", marker)
with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    report["planted"] = call(2)
    flush()
report["planted_executed"] = marker.exists()
report["planted_kept"] = (step_dir / "2" / "gen_batch.dp").is_file()

# 3. A run name that climbs out of dump_dir.
deep = root / "a" / "b" / "c" / "dumps"
deep.mkdir(parents=True)
SkipManager.init(run_config(deep, experiment="../../../escaped"))
call(1)
flush()
outside = [path for path in (root / "a").rglob("*") if path.is_file() and not path.is_relative_to(deep)]
report["escaped"] = sorted(str(path.relative_to(root)) for path in outside)
print(json.dumps(report))
