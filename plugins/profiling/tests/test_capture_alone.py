"""Capture runs in every worker and installs without the analysis stack (pyarrow, matplotlib:
the ``analysis`` extra); ``skip profile`` without it says in one line what to install."""

from __future__ import annotations

import json
import subprocess
import sys

ANALYSIS = ("pyarrow", "matplotlib")  # numpy comes with skip-core


def _run(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=False)


def test_capture_imports_nothing_of_the_analysis_stack(tmp_path):
    code = f"""
import json, sys
from skip_core import spans
from skip_plugin_profiling.recorder import Recorder
spans.attach(Recorder({str(tmp_path)!r}, worker=0))
with spans.span("generate", step=1):
    pass
spans.close()
print(json.dumps(sorted(m for m in sys.modules if m.split(".")[0] in {ANALYSIS!r})))
"""
    done = _run(code)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout) == []
    assert list(tmp_path.rglob("*.jsonl")), "the recorder wrote no log"


def test_the_report_without_the_analysis_stack_says_what_to_install(tmp_path):
    (tmp_path / "step_1").mkdir()
    # pyarrow made unimportable, as in an environment installed without the extra
    code = f"""
import sys
sys.modules["pyarrow"] = None
from skip_core.cli import cli
sys.argv = ["skip", "profile", "report", {str(tmp_path)!r}]
cli()
"""
    done = _run(code)
    assert done.returncode == 1
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1, done.stderr
    assert "pyarrow is missing" in lines[0] and "skip-plugin-profiling[analysis]" in lines[0]
