"""``SkipManager.init`` with ``skip.rollout`` on, in a fresh interpreter (``SKIP_PLUGINS`` is read
once per process). Prints JSON. Usage: python verl_role.py DUMP_DIR
"""

import json
import sys
import warnings
from pathlib import Path

import skip_core
from verl.utils.skip import SkipManager

from conftest import run_config

with warnings.catch_warnings(record=True) as said:
    warnings.simplefilter("always")
    SkipManager.init(run_config(Path(sys.argv[1])))
report = {
    "served_by": getattr(SkipManager, "served_by", None),
    "instances": {name: type(skip).__name__ for name, skip in SkipManager.skip_instances.items()},
    "stores": list(skip_core.SkipManager.stores()),
    "warnings": [str(w.message) for w in said if "skip" in str(w.message)],
}
print(json.dumps(report))
