"""Stand-in for SGLang's CPU kernel package, for SGLang on CPU in the test suite only (see ../README.md).

SGLang's CPU kernels (``sglang-kernel-cpu``) are not on PyPI, and PyPI's ``sgl-kernel`` is a CUDA
build. Without AMX, SGLang 0.5.23 takes plain-torch paths for norms, activations and rotary
embeddings, and needs from this package only what is here: the one allocation helper it calls,
and the hash of seeded sampling as a torch op (``torch.ops.sgl_kernel.murmur_hash32_cpu``, with a
fake kernel because the sampler runs under ``torch.compile``). Every other name SGLang imports
from here exists, and raises if called: none is called on this path. Never install this where
SGLang's real kernels are.
"""

from __future__ import annotations

import torch

_U32 = 0xFFFFFFFF


def assign_req_to_token_pool_cpu(req_pool_indices, req_to_token, start_offset, end_offset, out_cache_loc, pool_len):
    """Row ``req_pool_indices[i]`` of ``req_to_token`` gets, at ``start..end``, request i's slice of
    ``out_cache_loc`` (the slices follow each other in request order)."""
    del pool_len  # the row length, which req_to_token's shape already gives
    taken = 0
    for row, start, end in zip(req_pool_indices.tolist(), start_offset.tolist(), end_offset.tolist(), strict=True):
        req_to_token[row, start:end] = out_cache_loc[taken : taken + end - start]
        taken += end - start


def _rotl32(x: torch.Tensor, r: int) -> torch.Tensor:
    return ((x << r) | (x >> (32 - r))) & _U32


def _mix(h: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    # int64 products wrap modulo 2**64, which keeps their low 32 bits exact
    k = _rotl32((k * 0xCC9E2D51) & _U32, 15)
    k = (k * 0x1B873593) & _U32
    h = _rotl32(h ^ k, 13)
    return (h * 5 + 0xE6546B64) & _U32


def _fmix(h: torch.Tensor) -> torch.Tensor:
    h = h ^ (h >> 16)
    h = (h * 0x85EBCA6B) & _U32
    h = h ^ (h >> 13)
    h = (h * 0xC2B2AE35) & _U32
    return h ^ (h >> 16)


@torch.library.custom_op("sgl_kernel::murmur_hash32_cpu", mutates_args=())
def murmur_hash32_cpu(seed: torch.Tensor, positions: torch.Tensor, col_indices: torch.Tensor) -> torch.Tensor:
    """SGLang's 32-bit MurmurHash of (seed, position, column), shape (rows, columns), as its
    Triton kernel computes it: the same seed gives the same noise on any device."""
    seed = seed.view(torch.int64) if seed.dtype == torch.uint64 else seed.to(torch.int64)
    h = _mix(torch.zeros_like(seed), seed & _U32)
    h = _mix(h, (seed >> 32) & _U32)
    h = _mix(h, positions.to(torch.int64) & _U32)[:, None]
    h = _mix(h, col_indices.to(torch.int64)[None, :] & _U32)
    return _fmix(h ^ 16).to(torch.uint32)


@murmur_hash32_cpu.register_fake
def _(seed, positions, col_indices):
    return seed.new_empty((seed.shape[0], col_indices.shape[0]), dtype=torch.uint32)


def __getattr__(name: str):
    """Kernels SGLang imports here for paths this setup never takes (speculative decoding, KV moves)."""
    if name.startswith("__"):
        raise AttributeError(name)

    def absent(*args, **kwargs):
        raise NotImplementedError(f"sgl_kernel.{name}: not in the CPU stand-in (tests/sglang_cpu)")

    absent.__name__ = name
    return absent
