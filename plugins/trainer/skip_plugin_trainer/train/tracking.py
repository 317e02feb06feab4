"""``Tracking``: each step's metrics fanned out to the loggers of ``trainer.logger`` (console, JSON
lines, TensorBoard, W&B) without ever raising into training, and the run's ``metrics.jsonl`` kept
across a resume.
"""

from __future__ import annotations

import json
import warnings
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import rich.console
import rich.table
from skip_core import reading, writing
from skip_core.config import ConfigError

LOGGERS = ("console", "jsonl", "tensorboard", "wandb")

MAX_METRICS_BYTES = 1 << 30  # a run's metrics.jsonl, read back on resume

#: What to install for each optional logger (torch.utils.tensorboard needs the tensorboard package).
_PACKAGES = {"tensorboard": "tensorboard", "wandb": "wandb"}


class MetricsWarning(UserWarning):
    """A metrics logger failed and was switched off; training goes on."""


def _console_line(record: Mapping[str, float]) -> str:
    """The few numbers worth watching live; the rest go to the file loggers."""
    fields = [
        ("score", "critic/score/mean", "{:.4f}"),
        ("resp_len", "response_length/mean", "{:.1f}"),
        ("pg_loss", "actor/pg_loss", "{:.4g}"),
        ("grad_norm", "actor/grad_norm", "{:.4g}"),
        ("gen", "timing_s/gen", "{:.2f}s"),
        ("step_time", "timing_s/step", "{:.2f}s"),
        ("val_score", "val/score/mean", "{:.4f}"),
    ]
    parts = [f"step {record['step']}"] + [f"{label} {fmt.format(record[k])}" for label, k, fmt in fields if k in record]
    return " | ".join(parts)


def _read_jsonl(path: Path) -> list[dict[str, Any]]:
    """Records of a metrics file; lines that do not parse (a crash mid-write, or nested past any
    metric) are dropped, and a file that is no regular file (a pipe would block) or past
    ``MAX_METRICS_BYTES`` is left out whole, with a warning: the run then writes a new one."""
    try:
        text = reading.read_bytes(path, MAX_METRICS_BYTES).decode("utf-8", errors="replace")
    except (OSError, ValueError) as exc:
        warnings.warn(f"metrics: not keeping the lines of {path}: {exc}", MetricsWarning, stacklevel=3)
        return []
    records = []
    for line in text.splitlines():
        try:
            record = reading.loads(line)
        except ValueError:
            continue
        if isinstance(record, dict) and isinstance(record.get("step"), int):
            records.append(record)
    return records


def _import_logger(name: str) -> Any:
    """Import the optional library now, so a missing one is a config error before training starts."""
    try:
        if name == "tensorboard":
            from torch.utils.tensorboard import SummaryWriter

            return SummaryWriter
        import wandb

        return wandb
    except ImportError as exc:
        raise ConfigError(
            f"trainer.logger: {name} cannot be imported ({exc}); install it with `pip install {_PACKAGES[name]}`, "
            f"or drop {name} from trainer.logger"
        ) from None


def check_loggers(loggers: Sequence[str]) -> dict[str, Any]:
    """The logger modules ``loggers`` need; ``ConfigError`` for an unknown name or a missing package."""
    unknown = [b for b in loggers if b not in LOGGERS]
    if unknown:
        raise ConfigError(f"trainer.logger: unknown logger {unknown[0]!r}; allowed: {', '.join(LOGGERS)}")
    return {b: _import_logger(b) for b in loggers if b in ("tensorboard", "wandb")}


class Tracking:
    """Fan one metrics dict per step out to the loggers named in trainer.logger."""

    def __init__(
        self,
        loggers: Sequence[str],
        run_dir: Path,
        config: Mapping | None = None,
        *,
        project: str = "skip",
        experiment: str = "run",
        console: rich.console.Console | None = None,
        resume_step: int = 0,
    ) -> None:
        """Check every logger can start before training does (bad names and missing packages are ValueError).

        With the jsonl logger an existing metrics.jsonl keeps only steps <= ``resume_step`` (all of them go when
        0), so the steps a resumed run repeats are not logged twice.
        """
        modules = check_loggers(loggers)
        self.run_dir = Path(run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.jsonl_path = self.run_dir / "metrics.jsonl"
        self._history: list[dict[str, Any]] = []
        if "jsonl" in loggers and self.jsonl_path.exists():
            self._history = [r for r in _read_jsonl(self.jsonl_path) if r["step"] <= resume_step]
            self._rewrite(self._history)
        self._console = console or rich.console.Console()
        self._writer = self._wandb_run = None
        if "tensorboard" in modules:
            self._writer = modules["tensorboard"](log_dir=str(self.run_dir / "tensorboard"))
        if "wandb" in modules:
            self._wandb_run = modules["wandb"].init(
                project=project, name=experiment, config=dict(config or {}), dir=str(self.run_dir)
            )
        self._active = list(dict.fromkeys(loggers))
        self._staged: dict[str, Any] | None = None

    def _log_console(self, record: dict[str, Any]) -> None:
        self._console.print(_console_line(record), markup=False, highlight=False)

    def _log_jsonl(self, record: dict[str, Any]) -> None:
        # Opened per line: closing flushes, so the line is readable at once, and no handle can leak.
        with writing.appending(self.run_dir, self.jsonl_path.name) as f:
            f.write((json.dumps(record) + "\n").encode())

    def _rewrite(self, history: list[dict[str, Any]]) -> None:
        writing.write_bytes(self.run_dir, self.jsonl_path.name, "".join(json.dumps(r) + "\n" for r in history).encode())

    def _log_tensorboard(self, record: dict[str, Any]) -> None:
        for key, value in record.items():
            if key != "step":
                self._writer.add_scalar(key, value, record["step"])

    def _log_wandb(self, record: dict[str, Any]) -> None:
        self._wandb_run.log({k: v for k, v in record.items() if k != "step"}, step=record["step"])

    def _disable(self, name: str, exc: BaseException) -> None:
        self._active.remove(name)
        warnings.warn(f"metrics logger {name!r} failed and is disabled for this run: {exc!r}", MetricsWarning, 3)

    def stage(self, data: Mapping[str, float], step: int) -> None:
        """Write a step's metrics so far to metrics.jsonl only, before a checkpoint: a run killed
        before ``log`` resumes after this step and keeps this line; ``log`` replaces it."""
        if "jsonl" not in self._active:
            return
        self._staged = {"step": int(step), **{k: float(v) for k, v in data.items()}}
        self._history.append(self._staged)
        self._log("jsonl", self._staged)

    def log(self, data: Mapping[str, float], step: int) -> None:
        """Send one step's metrics to every live logger; a failing logger is warned about and dropped."""
        record = {"step": int(step), **{k: float(v) for k, v in data.items()}}
        replaces = self._staged is not None and self._staged["step"] == record["step"]
        if replaces:
            self._history.remove(self._staged)
        self._staged = None
        self._history.append(record)
        for name in list(self._active):
            if name == "jsonl" and replaces:
                self._log(name, record, rewrite=True)
            else:
                self._log(name, record)

    def _log(self, name: str, record: dict[str, Any], rewrite: bool = False) -> None:
        try:
            if rewrite:
                self._rewrite(self.history)
            else:
                getattr(self, f"_log_{name}")(record)
        except Exception as exc:
            self._disable(name, exc)

    @property
    def history(self) -> list[dict[str, Any]]:
        """Steps kept from an earlier run plus those logged here, ordered by step, for the end-of-run summary."""
        return sorted(self._history, key=lambda r: r["step"])

    def close(self) -> None:
        """Flush and close the remote/file writers; failures warn, since the run itself is already done."""
        closers = {"tensorboard": lambda: self._writer.close(), "wandb": lambda: self._wandb_run.finish()}
        for name in [n for n in self._active if n in closers]:
            try:
                closers[name]()
            except Exception as exc:
                self._disable(name, exc)
        self._active = []
