"""verl reporting a version the bridge was not tested with: one warning, verl's own manager.

The bridge reads the version of the verl being imported (``verl.__version__``); this script
sets it as a newer verl would before ``verl.utils.skip`` is imported. Prints JSON.
"""

import json
import warnings

import verl

verl.__version__ = "0.10.0"
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    import verl.experimental.agent_loop.agent_loop
    import verl.utils.skip.skip_manager
    from verl.utils.skip import SkipManager

said = [str(w.message) for w in caught if "skip-plugin-verl" in str(w.message)]
print(json.dumps({"served_by": getattr(SkipManager, "served_by", None), "warnings": said}))
