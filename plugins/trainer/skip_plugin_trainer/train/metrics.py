"""Metrics of a GRPO training run, named like verl's (``critic/score/mean``, ``timing_s/gen``, ``perf/throughput``)
so verl users read them at a glance: per-step computations from a ``Batch``, a ``Tracking`` logger that fans each
step out to console, JSON lines, TensorBoard or W&B without ever raising into training, and an end-of-run table
and plot.
"""

from __future__ import annotations

import io
import json
import math
import re
import warnings
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import rich.console
import rich.table
import torch
from skip_core import reading
from skip_core.batch import Batch
from skip_core.config import ConfigError
from skip_core.files import write_atomic

if TYPE_CHECKING:
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure

BACKENDS = ("console", "jsonl", "tensorboard", "wandb")
MAX_METRICS_BYTES = 1 << 30  # a run's metrics.jsonl, read back on resume
#: What to install for each optional backend (torch.utils.tensorboard needs the tensorboard package).
_PACKAGES = {"tensorboard": "tensorboard", "wandb": "wandb"}
#: The driver's timed phases (``StepRecord.timed``) in the order a step runs them, the sync schedule's and the
#: overlapped schedules' own weight syncs, so each keeps its place and colour from run to run.
_PHASES = (
    "gen",
    "sync_rollout_weights",
    "reward",
    "old_log_prob",
    "ref",
    "adv",
    "update_actor",
    "update_weights",
    "param_sync",
    "testing",
    "save_checkpoint",
)
#: ``testing`` times the validation rollouts and their scoring; "other" would hide the largest phase of a due step.
_PHASE_LABELS = {"testing": "validation"}
#: one_step_off's generation of a batch on the rollout pool, while the previous step trained: not part of the step.
_BACKGROUND = "generate_async"
_PER_TOKEN_PHASES = ("reward", "old_log_prob", "ref", "adv", "update_actor")
_TRAIN_SCORE = "critic/score/mean"
_VAL_MEAN = re.compile(r"^val(-core)?/.*(score|reward)/mean(@\d+)?$")


class MetricsWarning(UserWarning):
    """A metrics backend failed and was switched off; training goes on."""


def _stats(name: str, values: torch.Tensor | np.ndarray) -> dict[str, float]:
    """mean/max/min as Python floats; NaN when empty so a batch without loss tokens cannot crash the step."""
    values = torch.as_tensor(values, dtype=torch.float64)
    if values.numel() == 0:
        return {f"{name}/{s}": math.nan for s in ("mean", "max", "min")}
    return {
        f"{name}/mean": float(values.mean()),
        f"{name}/max": float(values.max()),
        f"{name}/min": float(values.min()),
    }


def _lengths(batch: Batch) -> tuple[torch.Tensor, torch.Tensor]:
    """Prompt and response lengths per row from ``attention_mask`` (prompt = first P columns, response = last T)."""
    width = batch.batch["responses"].shape[-1]
    mask = batch.batch["attention_mask"].float()
    return mask[:, :-width].sum(-1), mask[:, -width:].sum(-1)


def data_metrics(batch: Batch) -> dict[str, float]:
    """Score, reward, advantage and length statistics of one training batch (verl's ``compute_data_metrics``)."""
    tensors = batch.batch
    width = tensors["responses"].shape[-1]
    loss_tokens = tensors["response_mask"].bool()
    prompt_length, response_length = _lengths(batch)
    metrics = {
        **_stats("critic/score", tensors["token_level_scores"].sum(-1)),
        **_stats("critic/rewards", tensors["token_level_rewards"].sum(-1)),
        **_stats("critic/advantages", tensors["advantages"][loss_tokens]),
        **_stats("response_length", response_length),
        "response_length/clip_ratio": float((response_length == width).float().mean()),
        **_stats("prompt_length", prompt_length),
    }
    if "num_turns" in batch.non_tensor_batch:
        metrics.update(_stats("num_turns", np.asarray(batch.non_tensor_batch["num_turns"], dtype=np.float64)))
    if "overlong_reward" in batch.non_tensor_batch:  # reward.overlong_buffer (DAPO)
        overlong = np.asarray(batch.non_tensor_batch["overlong_reward"], dtype=np.float64)
        metrics["reward/overlong_reward/mean"] = float(overlong.mean())
        metrics["reward/overlong_ratio"] = float((overlong < 0).mean())
    return metrics


def timing_metrics(timing: Mapping[str, float], batch: Batch) -> dict[str, float]:
    """Seconds per phase, and milliseconds per token so steps with different lengths compare."""
    prompt_length, response_length = _lengths(batch)
    response_tokens = float(response_length.sum())
    all_tokens = response_tokens + float(prompt_length.sum())
    metrics = {f"timing_s/{name}": float(seconds) for name, seconds in timing.items()}
    if "gen" in timing:
        metrics["timing_per_token_ms/gen"] = float(timing["gen"]) * 1000 / response_tokens
    for name in _PER_TOKEN_PHASES:
        if name in timing:
            metrics[f"timing_per_token_ms/{name}"] = float(timing[name]) * 1000 / all_tokens
    return metrics


def throughput_metrics(timing: Mapping[str, float], batch: Batch, n_workers: int = 1) -> dict[str, float]:
    """Tokens per second per worker over the whole step, verl's ``perf/throughput``."""
    tokens = float(batch.batch["attention_mask"].sum())
    step_time = float(timing["step"])
    return {
        "perf/total_num_tokens": tokens,
        "perf/time_per_step": step_time,
        "perf/throughput": tokens / step_time / n_workers,
    }


def engine_metrics(before: Mapping[str, float], now: Mapping[str, float]) -> dict[str, float]:
    """What the rollout engines did during one step: each counter's increase since ``before``.
    In an overlapped schedule that is the generation running beside the step's training."""
    # A counter lower than before belongs to an engine restarted meanwhile: it counted from zero.
    change = {
        name: value - before.get(name, 0.0) if value >= before.get(name, 0.0) else value for name, value in now.items()
    }
    metrics = {f"rollout/engine/{name}": float(value) for name, value in change.items()}
    if change.get("decode_passes"):
        metrics["rollout/engine/batch_rows_mean"] = change["decode_rows"] / change["decode_passes"]
    return metrics


def _console_line(record: Mapping[str, float]) -> str:
    """The few numbers worth watching live; the rest go to the file backends."""
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


def _import_backend(name: str) -> Any:
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


def check_backends(backends: Sequence[str]) -> dict[str, Any]:
    """The logger modules ``backends`` need; ``ConfigError`` for an unknown name or a missing package."""
    unknown = [b for b in backends if b not in BACKENDS]
    if unknown:
        raise ConfigError(f"trainer.logger: unknown logger {unknown[0]!r}; allowed: {', '.join(BACKENDS)}")
    return {b: _import_backend(b) for b in backends if b in ("tensorboard", "wandb")}


class Tracking:
    """Fan one metrics dict per step out to the loggers named in trainer.logger."""

    def __init__(
        self,
        backends: Sequence[str],
        run_dir: Path,
        config: Mapping | None = None,
        *,
        project: str = "skip",
        experiment: str = "run",
        console: rich.console.Console | None = None,
        resume_step: int = 0,
    ) -> None:
        """Check every backend can start before training does (bad names and missing packages are ValueError).

        With the jsonl backend an existing metrics.jsonl keeps only steps <= ``resume_step`` (all of them go when
        0), so the steps a resumed run repeats are not logged twice.
        """
        modules = check_backends(backends)
        self.run_dir = Path(run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.jsonl_path = self.run_dir / "metrics.jsonl"
        self._history: list[dict[str, Any]] = []
        if "jsonl" in backends and self.jsonl_path.exists():
            self._history = [r for r in _read_jsonl(self.jsonl_path) if r["step"] <= resume_step]
            write_atomic(self.jsonl_path, "".join(json.dumps(r) + "\n" for r in self._history).encode())
        self._console = console or rich.console.Console()
        self._writer = self._wandb_run = None
        if "tensorboard" in modules:
            self._writer = modules["tensorboard"](log_dir=str(self.run_dir / "tensorboard"))
        if "wandb" in modules:
            self._wandb_run = modules["wandb"].init(
                project=project, name=experiment, config=dict(config or {}), dir=str(self.run_dir)
            )
        self._active = list(dict.fromkeys(backends))
        self._staged: dict[str, Any] | None = None

    def _log_console(self, record: dict[str, Any]) -> None:
        self._console.print(_console_line(record), markup=False, highlight=False)

    def _log_jsonl(self, record: dict[str, Any]) -> None:
        # Opened per line: closing flushes, so the line is readable at once, and no handle can leak.
        with self.jsonl_path.open("a", encoding="utf-8") as f:
            f.write(json.dumps(record) + "\n")

    def _log_tensorboard(self, record: dict[str, Any]) -> None:
        for key, value in record.items():
            if key != "step":
                self._writer.add_scalar(key, value, record["step"])

    def _log_wandb(self, record: dict[str, Any]) -> None:
        self._wandb_run.log({k: v for k, v in record.items() if k != "step"}, step=record["step"])

    def _disable(self, name: str, exc: BaseException) -> None:
        self._active.remove(name)
        warnings.warn(f"metrics backend {name!r} failed and is disabled for this run: {exc!r}", MetricsWarning, 3)

    def stage(self, data: Mapping[str, float], step: int) -> None:
        """Write a step's metrics so far to metrics.jsonl only, before a checkpoint: a run killed
        before ``log`` resumes after this step and keeps this line; ``log`` replaces it."""
        if "jsonl" not in self._active:
            return
        self._staged = {"step": int(step), **{k: float(v) for k, v in data.items()}}
        self._history.append(self._staged)
        self._log("jsonl", self._staged)

    def log(self, data: Mapping[str, float], step: int) -> None:
        """Send one step's metrics to every live backend; a failing backend is warned about and dropped."""
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
                write_atomic(self.jsonl_path, "".join(json.dumps(r) + "\n" for r in self.history).encode())
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


def _fmt(value: Any, spec: str = "{:.4g}") -> str:
    return "-" if value is None else spec.format(value)


def _totals(history: Sequence[Mapping[str, Any]]) -> str:
    """One line answering: how long did it take, where did the time go, did the score move."""
    steps = [r["timing_s/step"] for r in history if "timing_s/step" in r]
    gens = [r["timing_s/gen"] for r in history if "timing_s/step" in r and "timing_s/gen" in r]
    scores = [r["critic/score/mean"] for r in history if "critic/score/mean" in r]
    total = sum(steps) if steps else None
    return " · ".join(
        [
            f"total {_fmt(total, '{:.1f}')}s",
            f"mean step {_fmt(total / len(steps) if steps else None, '{:.2f}')}s",
            f"gen {_fmt(sum(gens) / total * 100 if gens and total else None, '{:.0f}')}% of step time",
            f"score {_fmt(scores[0] if scores else None)} → {_fmt(scores[-1] if scores else None)}",
        ]
    )


def summary_table(history: Sequence[Mapping[str, Any]], title: str = "skip run") -> rich.table.Table:
    """End-of-run overview, one row per step, with run totals in the caption."""
    columns = [
        ("score", "critic/score/mean", "{:.4g}"),
        ("resp len", "response_length/mean", "{:.4g}"),
        ("entropy", "actor/entropy", "{:.4g}"),
        ("pg loss", "actor/pg_loss", "{:.4g}"),
        ("grad norm", "actor/grad_norm", "{:.4g}"),
        ("gen s", "timing_s/gen", "{:.2f}"),
        ("step s", "timing_s/step", "{:.2f}"),
    ]
    table = rich.table.Table(title=title, caption=_totals(history))
    table.add_column("step", justify="right")
    for label, _, _ in columns:
        table.add_column(label, justify="right")
    for record in history:
        table.add_row(str(record.get("step", "-")), *(_fmt(record.get(key), spec) for _, key, spec in columns))
    return table


def plot(history: Sequence[Mapping[str, Any]], path: Path) -> Path:
    """``plot_figure`` as a PNG at ``path``, written atomically so a crash never leaves half an image."""
    buffer = io.BytesIO()
    plot_figure(history).savefig(buffer, format="png")
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    write_atomic(path, buffer.getvalue())
    return path


def plot_figure(history: Sequence[Mapping[str, Any]]) -> Figure:
    """Score and stacked phase times per step, so a cached (collapsed) gen phase stands out; returned rather than
    saved so its lines and bars can be read back. Legends sit right of the axes, where they cannot cover data."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.ticker import MaxNLocator

    fig = Figure(figsize=(10, 6), layout="constrained")
    FigureCanvasAgg(fig)
    score_ax, time_ax = fig.subplots(2, 1, sharex=True)
    for keys, steps, values in _score_series(history):
        style = {"marker": "o"} if keys[0] == _TRAIN_SCORE else {"marker": "s", "linestyle": "--"}
        score_ax.plot(steps, values, label=" = ".join("train" if k == _TRAIN_SCORE else k for k in keys), **style)
    score_ax.set_ylabel("score mean")
    _phase_bars(time_ax, history)
    time_ax.set_xlabel("step")
    time_ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    time_ax.set_ylabel("step time (s)")
    for ax in (score_ax, time_ax):
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize="small", loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0.0)
    return fig


def _score_series(history: Sequence[Mapping[str, Any]]) -> list[tuple[list[str], list[int], list[float]]]:
    """Train, then validation score means (overall before per source) as (keys, steps, values). A series equal to
    one already kept joins its keys instead of drawing a second line on top of it: the only data source's mean is
    the overall mean (``val/score/mean = val/arithmetic/score/mean``); train is val in a run scoring 0 throughout."""
    val_keys = sorted({k for r in history for k in r if _VAL_MEAN.match(k)}, key=lambda k: (k.count("/"), k))
    series: list[tuple[list[str], list[int], list[float]]] = []
    for key in (_TRAIN_SCORE, *val_keys):
        steps, values = [r["step"] for r in history if key in r], [r[key] for r in history if key in r]
        if not steps:
            continue
        same = next((s for s in series if s[1] == steps and np.allclose(s[2], values, equal_nan=True)), None)
        if same is None:
            series.append(([key], steps, values))
        else:
            same[0].append(key)
    return series


def _phase_bars(ax: Axes, history: Sequence[Mapping[str, Any]]) -> None:
    """Every phase the driver timed, stacked in the order it runs, then "other" up to the step's wall time (the
    prompts' loading, metrics: the step outside every phase). A phase missing from ``_PHASES`` (a new schedule's)
    gets a bar of its own after them rather than vanishing into "other"."""
    from matplotlib import colormaps

    timed = [r for r in history if any(k.startswith("timing_s/") for k in r)]
    names = {k.removeprefix("timing_s/") for r in timed for k in r if k.startswith("timing_s/")}
    phases = [p for p in _PHASES if p in names] + sorted(names - {*_PHASES, "step", _BACKGROUND})
    # tab20's strong hues, then its light ones, without its grays: gray is "other".
    tab20 = colormaps["tab20"].colors
    palette = [tab20[i] for i in (*range(0, 20, 2), *range(1, 20, 2)) if i not in (14, 15)]
    steps = [r["step"] for r in timed]
    bottom = np.zeros(len(timed))
    for phase in phases:
        heights = np.array([r.get(f"timing_s/{phase}", 0.0) for r in timed])
        color = palette[(*_PHASES, *phases).index(phase) % len(palette)]
        ax.bar(steps, heights, bottom=bottom, label=_PHASE_LABELS.get(phase, phase), color=color)
        bottom += heights
    other = np.array([max(r.get("timing_s/step", 0.0) - b, 0.0) for r, b in zip(timed, bottom, strict=True)])
    if other.any():
        ax.bar(steps, other, bottom=bottom, label="other", color="lightgray")
    # generate_async ran on the rollout pool while the previous step's phases ran (its wait shows as this step's
    # gen): stacked, it would add seconds the step did not take, so it is a line over the bars, not a bar.
    background = [r for r in timed if f"timing_s/{_BACKGROUND}" in r]
    if background:
        seconds = [r[f"timing_s/{_BACKGROUND}"] for r in background]
        label = f"{_BACKGROUND} (background, not stacked)"
        ax.plot([r["step"] for r in background], seconds, color="black", marker="D", linestyle=":", label=label)
