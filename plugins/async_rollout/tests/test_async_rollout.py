import asyncio
import threading

import numpy as np
import pytest
import torch
from skip_core import Batch, SkipManager, hookimpl
from skip_core.encoding import read
from skip_core.entries import scan
from skip_core.plugins import load_plugins
from skip_plugin_async_rollout import feed_index
from skiptests import run_config


class StreamingRollouter:
    """verl's per-sample entry point shape: ``generate_sequences_single(self, prompts, sample_id)``."""

    def __init__(self) -> None:
        self.ran: list[int] = []

    @SkipManager.annotate(role="async_rollout")
    async def generate_sequences_single(self, prompts: Batch, sample_id: str | None = None) -> Batch:
        index = int(prompts.batch["index"][0])
        self.ran.append(index)
        await asyncio.sleep(0)  # let the other samples interleave
        return Batch.from_dict({"responses": torch.full((1, 4), index)}, {"uid": prompts.non_tensor_batch["uid"]})


class LookupBegun:
    """``begun`` is set as a lookup of ``step`` begins, just before core's own: from then on the call
    either waits for that entry or misses and runs its function."""

    def __init__(self, step: int) -> None:
        self.step, self.begun = step, threading.Event()

    @hookimpl(tryfirst=True)
    def skip_precondition(self, step):
        if step == self.step:
            self.begun.set()


@pytest.fixture
def lookup_begun():
    """``lookup_begun(step)`` watches the lookups of ``step`` from now on, until the test ends."""
    pm, made = load_plugins(), []

    def watch(step: int) -> LookupBegun:
        made.append(LookupBegun(step))
        pm.register(made[-1])
        return made[-1]

    yield watch
    for watcher in made:
        pm.unregister(watcher)


def sample(index: int, epoch: int = 0, uid: str | None = None) -> Batch:
    uid = uid if uid is not None else f"uid_sample_{epoch}_{index}"
    return Batch.from_dict({"index": torch.tensor([index])}, {"uid": np.array([uid], dtype=object)})


@pytest.mark.parametrize(("sample_id", "index"), [("sample_0_42", 42), ("uid_sample_3_7", 7), ("sample_10_0", 0)])
def test_feed_index_is_the_last_number(sample_id, index):
    assert feed_index(sample_id) == index


@pytest.mark.parametrize("bad", ["sample_1", "sample_a_1", "sample_1_-2", "sample_1_2_extra", "42", 42, None, ""])
def test_malformed_sample_ids_raise_quoting_the_id_and_the_form(bad):
    with pytest.raises(ValueError, match=r"malformed sample id .*expected sample_\{epoch\}_\{index\}") as error:
        feed_index(bad)
    assert repr(bad) in str(error.value)


def test_a_malformed_id_in_a_call_raises_value_error(tmp_path):
    SkipManager.init(run_config(tmp_path, role="async_rollout", steps=[1]))
    with pytest.raises(ValueError, match="'sample_oops'"):
        asyncio.run(StreamingRollouter().generate_sequences_single(sample(1), sample_id="sample_oops"))


def test_explicit_sample_id_wins_over_uid(tmp_path):
    SkipManager.init(run_config(tmp_path, role="async_rollout", steps=[5]))
    rollouter = StreamingRollouter()
    asyncio.run(rollouter.generate_sequences_single(sample(1, uid="sample_0_1"), "sample_0_5"))  # positional
    SkipManager.flush()
    assert [p.name for p in scan(tmp_path)] == ["5"]


def test_uid_gives_the_step_when_no_sample_id_is_passed(tmp_path):
    SkipManager.init(run_config(tmp_path, role="async_rollout", steps=[3]))
    rollouter = StreamingRollouter()
    asyncio.run(rollouter.generate_sequences_single(sample(3)))
    SkipManager.flush()
    asyncio.run(rollouter.generate_sequences_single(sample(3)))
    assert rollouter.ran == [3]


def test_trainer_step_does_not_drive_the_async_role(tmp_path):
    SkipManager.init(run_config(tmp_path, role="async_rollout", steps=[1]))
    SkipManager.set_step(1)
    asyncio.run(StreamingRollouter().generate_sequences_single(sample(2)))
    SkipManager.flush()
    assert list(scan(tmp_path)) == []


def test_a_thousand_concurrent_samples_each_resolve_load_and_dump_their_own_step(tmp_path, held_dumps, lookup_begun):
    count, held_sample = 1000, 8
    eligible = set(range(0, count, 2))
    held = held_dumps([held_sample])  # one sample's dump stays pending throughout
    SkipManager.init(run_config(tmp_path, role="async_rollout", steps=sorted(eligible)))

    async def feed(rollouter, indices):
        return await asyncio.gather(*(rollouter.generate_sequences_single(sample(i), f"sample_0_{i}") for i in indices))

    first = StreamingRollouter()
    outputs = asyncio.run(feed(first, range(count)))
    assert sorted(first.ran) == list(range(count))

    # No flush: each replayed sample waits for its own dump at most, never for the held one.
    others = [i for i in range(count) if i != held_sample]
    second = StreamingRollouter()
    replayed = asyncio.run(feed(second, others))
    assert sorted(second.ran) == sorted(set(others) - eligible)
    for i, out in zip(others, replayed, strict=True):
        assert int(out.batch["responses"][0, 0]) == i
        assert out.equals(outputs[i])
    # Still held: had a replay waited for it, the hold's timeout would have let it through first.
    assert held_sample not in {int(p.name) for p in scan(tmp_path)}

    lookup = lookup_begun(held_sample)

    async def held_then_released():
        call = asyncio.create_task(second.generate_sequences_single(sample(held_sample), f"sample_0_{held_sample}"))
        assert await asyncio.to_thread(lookup.begun.wait, 60)
        # Its lookup is under way and the dump it needs is held: until the release it can only wait,
        # or miss and run the function (which it never does: below).
        assert not call.done()
        held.release(held_sample)
        return await call

    assert asyncio.run(held_then_released()).equals(outputs[held_sample])
    assert held_sample not in second.ran
    SkipManager.flush()
    assert sorted(int(p.name) for p in scan(tmp_path)) == sorted(eligible)


def test_threads_resolving_online_steps_never_see_each_others_step(tmp_path):
    SkipManager.init(run_config(tmp_path, role="async_rollout", steps=list(range(16))))
    rollouter = StreamingRollouter()
    barrier = threading.Barrier(8)
    results = {}

    def worker(i):
        barrier.wait()
        results[i] = asyncio.run(rollouter.generate_sequences_single(sample(i), f"sample_0_{i}"))

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    SkipManager.flush()
    for entry in scan(tmp_path):
        assert int(read(entry).batch["responses"][0, 0]) == int(entry.name)
    assert all(int(r.batch["responses"][0, 0]) == i for i, r in results.items())
