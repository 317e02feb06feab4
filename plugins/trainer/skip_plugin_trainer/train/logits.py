"""Log-probs and entropy of response tokens from the model's logits, optionally a chunk of tokens
at a time (verl's ``entropy_from_logits_with_chunking``).

The logits come in the compute dtype. Whole, their float32 copy at the sampling temperature and
the softmax behind the entropy are each [tokens x vocabulary]: at 8k tokens and a 152k vocabulary
5 GB apiece. Chunked, only one chunk's float32 copies exist at a time in a no-gradient pass; with
a gradient, ``recompute`` (verl's ``entropy_checkpointing``) recomputes each chunk in the
backward pass instead of keeping its copies for it. The result is the same either way.
"""

from __future__ import annotations

import torch
from torch import Tensor
from torch.utils.checkpoint import checkpoint


def token_log_probs(
    logits: Tensor,
    labels: Tensor,
    *,
    temperature: float,
    entropy: bool,
    chunk: int | None = None,
    recompute: bool = False,
    sum_pi_squared: bool = False,
) -> tuple[Tensor, ...]:
    """``labels``' log-probs under ``logits / temperature`` (``[batch, positions]``), the entropy
    at each position when ``entropy`` (else None), and with ``sum_pi_squared`` a third tensor:
    the sum over the vocabulary of each position's squared probabilities (verl's, for the optimal
    token baseline); ``chunk`` tokens at a time (None: all at once)."""
    rows, positions, vocabulary = logits.shape
    flat, flat_labels = logits.reshape(-1, vocabulary), labels.reshape(-1)
    step = chunk or max(flat.shape[0], 1)
    pieces = []
    for start in range(0, flat.shape[0], step):
        part = (flat[start : start + step], flat_labels[start : start + step], temperature, entropy, sum_pi_squared)
        if recompute and torch.is_grad_enabled():
            pieces.append(checkpoint(_piece, *part, use_reentrant=False))
        else:
            pieces.append(_piece(*part))
    log_probs = torch.cat([p[0] for p in pieces]).reshape(rows, positions)
    entropys = torch.cat([p[1] for p in pieces]).reshape(rows, positions) if entropy else None
    if not sum_pi_squared:
        return log_probs, entropys
    return log_probs, entropys, torch.cat([p[2] for p in pieces]).reshape(rows, positions)


def _piece(logits: Tensor, labels: Tensor, temperature: float, entropy: bool, squares: bool) -> tuple[Tensor, ...]:
    scaled = logits.float() / temperature
    log_probs = log_probs_from_logits(scaled, labels)
    empty = log_probs.new_empty(0)
    # sum(pi^2) = exp(logsumexp(2 z) - 2 logsumexp(z)): no [tokens x vocabulary] softmax is kept
    square_sums = torch.exp(torch.logsumexp(2 * scaled, -1) - 2 * torch.logsumexp(scaled, -1)) if squares else empty
    return log_probs, entropy_from_logits(scaled) if entropy else empty, square_sums


def log_probs_from_logits(logits: Tensor, labels: Tensor) -> Tensor:
    """Log-prob of each label, via logsumexp so the full log-softmax over the vocabulary is never stored."""
    logits = logits.float()
    picked = logits.gather(-1, labels.unsqueeze(-1)).squeeze(-1)
    return picked - torch.logsumexp(logits, dim=-1)


def entropy_from_logits(logits: Tensor) -> Tensor:
    """Per-position entropy written as logsumexp minus the expected logit, which stays finite for large logits."""
    logits = logits.float()
    return torch.logsumexp(logits, dim=-1) - (torch.softmax(logits, dim=-1) * logits).sum(-1)
