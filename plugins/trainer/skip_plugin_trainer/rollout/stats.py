"""What a generated batch reports of its generation (``meta_info["rollout"]``): requests, turns,
tool calls, tokens, seconds and finish reasons, and the one summary of a batch generated in parts."""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from typing import Any

from skip_plugin_trainer.rollout.request import Request


def rollout_stats(requests: Sequence[Request], seconds: float, validate: bool) -> dict[str, Any]:
    """The summary of ``requests``, finished in ``seconds``."""
    generated = sum(sum(r.response_mask) for r in requests)
    return {
        "requests": len(requests),
        "turns": sum(r.turns for r in requests),
        "tool_calls": sum(r.tool_calls for r in requests),
        "generated_tokens": generated,
        "seconds": seconds,
        "tokens_per_second": generated / seconds if seconds > 0 else 0.0,
        "finish_reasons": dict(Counter(r.finish_reason for r in requests)),
        "validate": validate,
    }


def merge_rollout_stats(parts: Sequence[dict[str, Any]], concurrent: bool = True) -> dict[str, Any]:
    """One summary for a batch generated in parts, at the same time (one per rollout worker) or,
    not ``concurrent``, one after the other."""
    merged = {key: sum(p[key] for p in parts) for key in ("requests", "turns", "tool_calls", "generated_tokens")}
    merged["seconds"] = (max if concurrent else sum)(p["seconds"] for p in parts)
    merged["tokens_per_second"] = merged["generated_tokens"] / merged["seconds"] if merged["seconds"] > 0 else 0.0
    reasons: dict[str, int] = {}
    for part in parts:
        for reason, count in part["finish_reasons"].items():
            reasons[reason] = reasons.get(reason, 0) + count
    merged["finish_reasons"] = reasons
    merged["validate"] = parts[0]["validate"]
    return merged
