"""Dump and load a verl-shaped rollout batch: ``CacheStore`` against a raw file and pickle.

The batch is what verl's ``generate_sequences`` returns for 512 sequences of 1024 prompt
and 2048 response tokens. Every variant writes into (and reads from) the same directory,
and the variants run interleaved, in a new order each repetition, so that noise on a
shared machine falls on all of them alike.

dump
    skip    ``CacheStore.save(step, batch, fingerprint)``: safetensors + JSON, hashed,
            fsynced, renamed into place (the fingerprint is computed beforehand, as the
            ``skip_dump`` hook receives it)
    raw     the tensor bytes, one ``write`` each into one file, then flush and fsync
    pickle  ``pickle.dump`` of the same ``Batch`` object, then flush and fsync

load (then every byte of every tensor is touched by the same pass)
    skip    ``store.entry(step)`` (full xxh3 verification) + ``store.load(entry)``
    raw     read the raw file into memory, tensors made with ``torch.frombuffer``
    pickle  ``pickle.load`` of the pickle file
    mmap    (for information) the raw file memory-mapped, tensors made with ``torch.frombuffer``:
            the zero-copy floor that skip's memory-mapped safetensors can approach

Warm loads read from the page cache. Cold loads drop the page cache before each load
(``echo 3 > /proc/sys/vm/drop_caches``, root only); they are skipped where that fails.

Run: ``python benchmarks/bench_store.py --repeat 7``
"""

from __future__ import annotations

import argparse
import gc
import mmap
import os
import pickle
import random
import shutil
import statistics
import string
import tempfile
import time
import uuid
from collections.abc import Callable, Iterable
from pathlib import Path

import numpy as np
import torch
import xxhash
from skip_core import Batch
from skip_core.config import Namespace
from skip_core.encoding import fingerprint
from skip_core.store import CacheStore

SAMPLES = 512
PROMPT = 1024
RESPONSE = 2048
VOCAB = 151_936  # Qwen2.5's vocabulary, the usual verl example
DROP_CACHES = Path("/proc/sys/vm/drop_caches")
TARGET = 1.3  # the bound on skip / raw, for dump and for load


def make_batch(seed: int = 0) -> Batch:
    """A rollout batch with verl's keys, shapes and dtypes; deterministic for a seed."""
    gen = torch.Generator().manual_seed(seed)
    rng = random.Random(seed)
    total = PROMPT + RESPONSE
    prompts = torch.randint(0, VOCAB, (SAMPLES, PROMPT), generator=gen)
    responses = torch.randint(0, VOCAB, (SAMPLES, RESPONSE), generator=gen)
    prompt_pad = torch.randint(0, PROMPT // 2, (SAMPLES, 1), generator=gen)  # left padding
    response_len = torch.randint(1, RESPONSE + 1, (SAMPLES, 1), generator=gen)  # right padding
    columns = torch.arange(total).expand(SAMPLES, total)
    attention_mask = ((columns >= prompt_pad) & (columns < PROMPT + response_len)).long()
    position_ids = (attention_mask.cumsum(dim=1) - 1).clamp(min=0)
    words = ["".join(rng.choices(string.ascii_lowercase, k=rng.randint(2, 9))) for _ in range(2000)]
    raw_prompt = np.empty(SAMPLES, dtype=object)
    for i in range(SAMPLES):
        text = ""
        while len(text) < 1024:
            text += rng.choice(words) + " "
        raw_prompt[i] = text[:1024]
    uid = np.array([str(uuid.UUID(int=rng.getrandbits(128), version=4)) for _ in range(SAMPLES)], dtype=object)
    return Batch(
        {
            "prompts": prompts,
            "responses": responses,
            "input_ids": torch.cat([prompts, responses], dim=1),
            "attention_mask": attention_mask,
            "position_ids": position_ids,
            "response_mask": attention_mask[:, PROMPT:].contiguous(),
            "rollout_log_probs": -torch.rand((SAMPLES, RESPONSE), generator=gen) * 5,
        },
        {"uid": uid, "raw_prompt": raw_prompt},
        {"global_steps": 1, "temperature": 1.0},
    )


def tensor_bytes(tensors: Iterable[torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def touch(tensors: Iterable[torch.Tensor]) -> tuple[int, ...]:
    """Read every byte of every tensor, the same pass for every variant: xxh3-64 of each.

    (``t.view(torch.uint8).sum()`` would do, but at ~0.3 GB/s it would hide the rest.)
    """
    return tuple(xxhash.xxh3_64_intdigest(t.numpy()) for t in tensors)


# -- dump ---------------------------------------------------------------------------------


def fsync_file(f) -> None:
    f.flush()
    os.fsync(f.fileno())


def dump_raw(batch: Batch, path: Path) -> None:
    with open(path, "wb") as f:
        for t in batch.batch.values():
            f.write(t.numpy().data)
        fsync_file(f)


def dump_pickle(batch: Batch, path: Path) -> None:
    with open(path, "wb") as f:
        pickle.dump(batch, f, protocol=pickle.HIGHEST_PROTOCOL)
        fsync_file(f)


# -- load ---------------------------------------------------------------------------------


def load_skip(store: CacheStore, step: int) -> tuple[int, ...]:
    entry = store.entry(step)
    if entry is None:
        raise RuntimeError(f"entry {step} failed verification")
    return touch(store.load(entry).batch.values())


def load_raw(path: Path, layout: list[tuple[torch.dtype, tuple[int, ...]]]) -> tuple[int, ...]:
    with open(path, "rb") as f:
        buf = bytearray(os.fstat(f.fileno()).st_size)
        f.readinto(buf)
    return touch(raw_tensors(buf, layout))


def raw_tensors(buf, layout: list[tuple[torch.dtype, tuple[int, ...]]]) -> list[torch.Tensor]:
    tensors, offset = [], 0
    for dtype, shape in layout:
        count = int(np.prod(shape))
        tensors.append(torch.frombuffer(buf, dtype=dtype, count=count, offset=offset).view(shape))
        offset += count * dtype.itemsize
    return tensors


def load_mmap(path: Path, layout: list[tuple[torch.dtype, tuple[int, ...]]]) -> tuple[int, ...]:
    with open(path, "rb") as f:
        view = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)  # private: writable, so no torch warning
    return touch(raw_tensors(view, layout))


def load_pickle(path: Path) -> tuple[int, ...]:
    # The baseline verl uses; it reads back only the file dump_pickle wrote in this run's own
    # temporary directory, never anything supplied from outside.
    with open(path, "rb") as f:
        batch = pickle.load(f)
    return touch(batch.batch.values())


# -- timing -------------------------------------------------------------------------------


def can_drop_caches() -> bool:
    try:
        drop_caches()
    except OSError:
        return False
    return True


def drop_caches() -> None:
    os.sync()
    DROP_CACHES.write_text("3\n")


def timed(fn: Callable[[], object], prepare: Callable[[], None] | None = None) -> float:
    """Seconds ``fn`` takes; ``prepare`` runs first, untimed."""
    os.sync()
    if prepare is not None:
        prepare()
    gc.collect()
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def interleaved(variants: dict[str, Callable[[int], float]], repeat: int, seed: int) -> dict[str, list[float]]:
    """Run each variant ``repeat`` times, in a fresh random order each round."""
    rng = random.Random(seed)
    times: dict[str, list[float]] = {name: [] for name in variants}
    for i in range(repeat):
        order = list(variants)
        rng.shuffle(order)
        for name in order:
            times[name].append(variants[name](i))
    return times


def report(title: str, times: dict[str, list[float]], nbytes: int, baseline: str = "raw") -> list[str]:
    base_min, base_med = min(times[baseline]), statistics.median(times[baseline])
    columns = ("variant", "min ms", "median ms", "GB/s (min)", "x raw (min)", "x raw (median)")
    lines = [title, "  {:<8} {:>9} {:>10} {:>11} {:>12} {:>15}".format(*columns)]
    for name, samples in times.items():
        lo, med = min(samples), statistics.median(samples)
        lines.append(
            f"  {name:<8} {lo * 1e3:>9.1f} {med * 1e3:>10.1f} {nbytes / lo / 1e9:>11.2f}"
            f" {lo / base_min:>11.2f}x {med / base_med:>14.2f}x"
        )
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeat", type=int, default=7, help="rounds of every variant (default 7)")
    parser.add_argument("--dir", type=Path, default=None, help="where to write (default: the temp dir; TMPDIR)")
    parser.add_argument("--no-cold", action="store_true", help="skip cold-cache loads even where possible")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    base = Path(tempfile.mkdtemp(prefix="bench-store-", dir=args.dir))
    try:
        run(base, args.repeat, args.seed, cold=not args.no_cold)
    finally:
        shutil.rmtree(base, ignore_errors=True)


def run(base: Path, repeat: int, seed: int, cold: bool) -> None:
    batch = make_batch(seed)
    nbytes = tensor_bytes(batch.batch.values())
    layout = [(t.dtype, tuple(t.shape)) for t in batch.batch.values()]
    namespace = Namespace("bench", "store", SAMPLES, 1, PROMPT, RESPONSE)
    store = CacheStore(base / "dump", namespace, role="rollout")
    fp = fingerprint(batch)

    print(f"batch: {len(batch)} samples; tensors:")
    for key, t in batch.batch.items():
        print(f"  {key:<18} {tuple(t.shape)!s:<12} {t.dtype!s:<14} {tensor_bytes([t]) / 2**20:6.1f} MiB")
    print(f"  total tensor bytes: {nbytes:,} ({nbytes / 2**20:.1f} MiB, {nbytes / 1e6:.1f} MB)")
    print("  non_tensor_batch: uid (512 uuid strings), raw_prompt (512 x 1 KB strings)")
    print(f"directory: {base} (repeat {repeat}, torch threads {torch.get_num_threads()})")
    print()

    # dump: every round writes new files; they are removed untimed before the next write
    def dump_variant(write: Callable[[int], Path]) -> Callable[[int], float]:
        def one(i: int) -> float:
            written: list[Path] = []
            seconds = timed(lambda: written.append(write(i)))
            for path in written:
                shutil.rmtree(path) if path.is_dir() else path.unlink()
            return seconds

        return one

    store.check_writable()  # the directory the step directories go in; raw and pickle files go there too

    def write_raw(i: int) -> Path:
        dump_raw(batch, store.directory / f"raw-{i}.bin")
        return store.directory / f"raw-{i}.bin"

    def write_pickle(i: int) -> Path:
        dump_pickle(batch, store.directory / f"pickle-{i}.pkl")
        return store.directory / f"pickle-{i}.pkl"

    dumps = {
        "skip": dump_variant(lambda i: store.save(1000 + i, batch, fp)),
        "raw": dump_variant(write_raw),
        "pickle": dump_variant(write_pickle),
    }
    for one in dumps.values():  # warm-up round: imports, allocator, first directory creation
        one(-1)
    results = {"dump (write + fsync)": interleaved(dumps, repeat, seed)}

    # load: one file of each kind, read back every round
    store.save(0, batch, fp)
    raw_path, pickle_path = write_raw(0), write_pickle(0)
    expected = sorted(touch(batch.batch.values()))
    loads = {
        "skip": lambda: load_skip(store, 0),
        "raw": lambda: load_raw(raw_path, layout),
        "pickle": lambda: load_pickle(pickle_path),
        "mmap": lambda: load_mmap(raw_path, layout),
    }
    for name, load in loads.items():  # also warms the page cache
        if sorted(load()) != expected:
            raise RuntimeError(f"{name}: loaded bytes differ from the batch")
    warm = {name: (lambda i, load=load: timed(load)) for name, load in loads.items()}
    results["load, warm page cache (verify + read + touch every byte)"] = interleaved(warm, repeat, seed)
    notes = []
    if cold and can_drop_caches():
        cold_loads = {name: (lambda i, load=load: timed(load, drop_caches)) for name, load in loads.items()}
        results["load, cold page cache (dropped before each load)"] = interleaved(cold_loads, repeat, seed)
    elif cold:
        notes.append("load, cold: skipped (cannot write /proc/sys/vm/drop_caches): every load above is warm")

    lines = []
    for title, times in results.items():
        lines += report(title, times, nbytes)
    lines += [*notes, "", f"targets (skip / raw <= {TARGET}x, judged on the median):"]
    for title, times in results.items():
        lo = min(times["skip"]) / min(times["raw"])
        med = statistics.median(times["skip"]) / statistics.median(times["raw"])
        verdict = "met" if med <= TARGET else "MISSED"
        lines.append(f"  {title.split(' (')[0]:<24} min {lo:.2f}x  median {med:.2f}x  {verdict}")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
