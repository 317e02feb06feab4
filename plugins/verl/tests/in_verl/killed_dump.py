"""verl's V1 trainer killed (SIGKILL) while skip writes step 2's ``rollout_tq`` entry: the moment
its files are written and sealed, before the directory is published. Usage: python killed_dump.py DUMP_DIR
"""

import os
import signal
import sys
from pathlib import Path

import skip_core.store
import v1

publish = skip_core.store.publish


def publish_then_die(tmp: Path, final: Path, **how) -> None:
    if final.name == "2":
        os.kill(os.getpid(), signal.SIGKILL)
    publish(tmp, final, **how)


skip_core.store.publish = publish_then_die
v1.start_transfer_queue()
v1.fit(v1.verl_config(Path(sys.argv[1]), steps=(1, 2), total=2), v1.prompts(0))
