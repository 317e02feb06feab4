"""verl's V1 ``fit()`` with verl's own ``rollout_tq`` code (the bridge left out by ``SKIP_PLUGINS``):
it writes verl's ``tq_batch.pt`` dumps. Prints the logged metrics as JSON. Usage: python verl_dump.py DUMP_DIR
"""

import json
import sys
from pathlib import Path

import v1

v1.start_transfer_queue()
run = v1.fit(v1.verl_config(Path(sys.argv[1]), steps=(1, 2), total=2), v1.prompts(0))
from verl.utils.skip import SkipManager  # noqa: E402 (imported by fit)

print(json.dumps({"served_by": getattr(SkipManager, "served_by", None), "metrics": run.metrics}))
