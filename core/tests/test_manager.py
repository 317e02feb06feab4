import asyncio
import json
import shutil
import subprocess
import sys
import threading
from collections.abc import Callable
from types import SimpleNamespace

import pytest
import torch
from omegaconf import OmegaConf
from skip_core import Batch, SkipManager, encoding
from skip_core.caching import PromptMismatchError, PromptMismatchWarning
from skip_core.entries import file_digest, scan, verify
from skip_core.store import CacheWarning
from skiptests import Generator, make_prompts, run_config


def steps_on_disk(dump_dir) -> list[int]:
    return sorted(int(p.name) for p in dump_dir.glob("*/*/*") if p.name.isdigit())


def run_steps(generator: Generator, steps, prompts=None):
    outputs = []
    for step in steps:
        SkipManager.set_step(step)
        outputs.append(generator.generate_sequences(prompts or make_prompts(seed=step)))
    SkipManager.flush()
    return outputs


def test_disabled_role_runs_and_writes_nothing(tmp_path, generator):
    SkipManager.init(run_config(tmp_path, enable=False))
    run_steps(generator, [1, 1])
    assert generator.calls == 2
    assert list(tmp_path.iterdir()) == []


def test_without_init_the_function_just_runs(generator):
    run_steps(generator, [1])
    assert generator.calls == 1


def test_cache_dumps_listed_steps_then_loads_them(tmp_path, generator):
    SkipManager.init(run_config(tmp_path, steps=[1, 2]))
    first = run_steps(generator, [1, 2, 3])
    assert generator.calls == 3
    assert steps_on_disk(tmp_path) == [1, 2]

    again = run_steps(generator, [1, 2, 3])
    assert generator.calls == 4  # only step 3 ran again
    assert again[0].equals(first[0]) and again[1].equals(first[1])
    assert not again[2].equals(first[2])


def test_cache_survives_a_new_process_state(tmp_path, generator):
    """A second run (fresh init, fresh generator) loads what the first dumped."""
    SkipManager.init(run_config(tmp_path))
    (first,) = run_steps(generator, [2])
    SkipManager.reset()
    SkipManager.init(OmegaConf.create(run_config(tmp_path)))
    fresh = Generator()
    (loaded,) = run_steps(fresh, [2])
    assert fresh.calls == 0
    assert loaded.equals(first)
    assert loaded.meta_info["generated_by_call"] == 1


def test_ineligible_step_runs_and_is_not_dumped(tmp_path, generator):
    SkipManager.init(run_config(tmp_path, steps=[5]))
    run_steps(generator, [1, 2])
    assert generator.calls == 2
    assert steps_on_disk(tmp_path) == []


@pytest.mark.parametrize(
    ("cached", "step", "expected"),
    [
        ([2, 4, 6], 4, 4),  # the current step when valid
        ([2, 3, 6], 5, 3),  # else the largest below
        ([6, 9], 5, 6),  # else the smallest above
        ([], 5, None),  # else none: generate and dump
    ],
)
def test_repeat_picks_current_then_largest_below_then_smallest_above(tmp_path, cached, step, expected):
    producer = Generator()
    SkipManager.init(run_config(tmp_path, steps=cached))
    produced = {s: out for s, out in zip(cached, run_steps(producer, cached), strict=True)}

    SkipManager.init(run_config(tmp_path, steps=[step], action="repeat"))
    consumer = Generator()
    (result,) = run_steps(consumer, [step])
    if expected is None:
        assert consumer.calls == 1
        assert steps_on_disk(tmp_path) == [step]
    else:
        assert consumer.calls == 0
        assert result.equals(produced[expected])


def test_repeat_skips_a_corrupt_candidate(tmp_path):
    SkipManager.init(run_config(tmp_path, steps=[1, 3]))
    one, _ = run_steps(Generator(), [1, 3])
    (entry,) = tmp_path.glob("*/*/3")
    (entry / "tensors.safetensors").write_bytes(b"garbage")

    SkipManager.init(run_config(tmp_path, steps=[4], action="repeat"))
    consumer = Generator()
    with pytest.warns(CacheWarning, match="3"):
        (result,) = run_steps(consumer, [4])
    assert consumer.calls == 0
    assert result.equals(one)


def large_rollout(calls: list) -> Callable:
    """A rollout whose 64 MiB result (4096 x 4096 float32) is still being dumped when the next call comes."""

    @SkipManager.annotate(role="rollout")
    def generate_sequences(prompts):
        calls.append(len(calls) + 1)
        return Batch.from_dict({"responses": torch.rand(4096, 4096)}, meta_info={"call": len(calls)})

    return generate_sequences


def test_repeat_reuses_step_one_while_its_dump_is_still_running(tmp_path):
    """verl: an empty cache, repeat on steps 1-4 generates step 1 and repeats it on steps 2-4."""
    calls = []
    generate = large_rollout(calls)
    SkipManager.init(run_config(tmp_path, steps=[1, 2, 3, 4], action="repeat"))
    outputs = run_steps(SimpleNamespace(generate_sequences=generate), [1, 2, 3, 4])
    assert calls == [1]
    assert all(out.equals(outputs[0]) for out in outputs[1:])
    assert steps_on_disk(tmp_path) == [1]


def test_cache_runs_a_step_called_twice_in_a_row_once(tmp_path):
    calls = []
    generate = large_rollout(calls)
    SkipManager.init(run_config(tmp_path, steps=[1]))
    first, second = run_steps(SimpleNamespace(generate_sequences=generate), [1, 1])
    assert calls == [1]
    assert second.equals(first)
    assert steps_on_disk(tmp_path) == [1]


def call_in_thread(fn, *args) -> tuple[threading.Thread, dict]:
    out = {}
    thread = threading.Thread(target=lambda: out.setdefault("result", fn(*args)))
    thread.start()
    return thread, out


def test_a_lookup_waits_for_the_pending_dump_of_its_own_entry_only(tmp_path, generator, held_dumps):
    held = held_dumps([1])
    SkipManager.init(run_config(tmp_path, steps=[1, 2]))
    SkipManager.set_step(1)
    first = generator.generate_sequences(make_prompts())  # its dump is held
    SkipManager.set_step(2)
    generator.generate_sequences(make_prompts())  # another entry: returns without waiting
    SkipManager.set_step(1)
    thread, out = call_in_thread(generator.generate_sequences, make_prompts())
    thread.join(0.5)
    assert thread.is_alive() and generator.calls == 2  # waiting for step 1's dump, not running

    held.release(1)
    thread.join(30)
    assert generator.calls == 2
    assert out["result"].equals(first)


def test_a_pending_dump_that_fails_is_a_miss(tmp_path, generator, held_dumps):
    held = held_dumps([1], fail=True)
    SkipManager.init(run_config(tmp_path, steps=[1]))
    SkipManager.set_step(1)
    with pytest.warns(CacheWarning, match="dump failed.*no space left"):
        generator.generate_sequences(make_prompts())
        thread, out = call_in_thread(generator.generate_sequences, make_prompts())
        thread.join(0.5)
        assert thread.is_alive()
        held.release(1)
        thread.join(30)
        SkipManager.flush()
    assert generator.calls == 2
    assert out["result"].meta_info["generated_by_call"] == 2
    assert steps_on_disk(tmp_path) == []


def test_validation_calls_never_load_or_dump(tmp_path, generator):
    SkipManager.init(run_config(tmp_path, steps=[1]))
    run_steps(generator, [1], prompts=make_prompts(validate=True))
    assert steps_on_disk(tmp_path) == []
    run_steps(generator, [1])
    assert steps_on_disk(tmp_path) == [1]
    run_steps(generator, [1], prompts=make_prompts(validate=True))
    assert generator.calls == 3  # validation ran although step 1 is cached


def test_validation_flag_is_read_from_the_prompts_keyword(tmp_path, generator):
    SkipManager.init(run_config(tmp_path, steps=[1]))
    SkipManager.set_step(1)
    generator.generate_sequences(prompts=make_prompts(validate=True))
    SkipManager.flush()
    assert steps_on_disk(tmp_path) == []


def test_plain_functions_and_coroutines_are_cached(tmp_path):
    calls = []

    @SkipManager.annotate(role="rollout")
    def generate(prompts):
        calls.append("sync")
        return Generator().output(prompts)

    @SkipManager.annotate(role="rollout")
    async def agenerate(prompts):
        calls.append("async")
        return Generator().output(prompts)

    SkipManager.init(run_config(tmp_path, steps=[1]))
    SkipManager.set_step(1)
    first = generate(make_prompts())
    SkipManager.flush()
    assert asyncio.run(agenerate(make_prompts())).equals(first)
    assert generate(make_prompts()).equals(first)
    assert calls == ["sync"]
    assert asyncio.iscoroutinefunction(agenerate) and agenerate.__name__ == "agenerate"


def test_async_method_dumps_then_loads(tmp_path, generator):
    SkipManager.init(run_config(tmp_path, steps=[1]))
    SkipManager.set_step(1)
    first = asyncio.run(generator.agenerate_sequences(make_prompts()))
    SkipManager.flush()
    second = asyncio.run(generator.agenerate_sequences(make_prompts()))
    assert generator.calls == 1 and second.equals(first)


def test_prompt_mismatch_warns_and_loads_by_default(tmp_path, generator):
    SkipManager.init(run_config(tmp_path, steps=[1]))
    (first,) = run_steps(generator, [1], prompts=make_prompts(seed=1))
    with pytest.warns(PromptMismatchWarning, match="on_prompt_mismatch=warn"):
        (loaded,) = run_steps(generator, [1], prompts=make_prompts(seed=2))
    assert generator.calls == 1 and loaded.equals(first)


def test_prompt_mismatch_regenerate_replaces_the_entry(tmp_path, generator):
    SkipManager.init(run_config(tmp_path, steps=[1], on_prompt_mismatch="regenerate"))
    run_steps(generator, [1], prompts=make_prompts(seed=1))
    (regenerated,) = run_steps(generator, [1], prompts=make_prompts(seed=2))
    (loaded,) = run_steps(generator, [1], prompts=make_prompts(seed=2))
    assert generator.calls == 2
    assert loaded.equals(regenerated)


def test_prompt_mismatch_error_raises(tmp_path, generator):
    SkipManager.init(run_config(tmp_path, steps=[1], on_prompt_mismatch="error"))
    run_steps(generator, [1], prompts=make_prompts(seed=1))
    with pytest.raises(PromptMismatchError, match="different inputs"):
        run_steps(generator, [1], prompts=make_prompts(seed=2))


def test_uid_does_not_count_as_a_prompt_change(tmp_path, generator):
    SkipManager.init(run_config(tmp_path, steps=[1], on_prompt_mismatch="error"))
    prompts = make_prompts()
    run_steps(generator, [1], prompts=prompts)
    prompts.non_tensor_batch["uid"][:] = "fresh-uuid"
    run_steps(generator, [1], prompts=prompts)
    assert generator.calls == 1


def test_failed_dump_warns_and_returns_the_result(tmp_path, generator):
    SkipManager.init(run_config(tmp_path, steps=[1]))

    @SkipManager.annotate(role="rollout")
    def unstorable(prompts):
        return {"not": "a batch"}

    SkipManager.set_step(1)
    with pytest.warns(CacheWarning, match="dump failed"):
        assert unstorable(make_prompts()) == {"not": "a batch"}
        SkipManager.flush()


def test_dump_into_a_vanished_directory_warns_and_training_goes_on(tmp_path, generator):
    target = tmp_path / "cache"
    SkipManager.init(run_config(target, steps=[1, 2]))
    shutil.rmtree(target)
    target.write_text("a file where the cache directory was")
    SkipManager.set_step(1)
    with pytest.warns(CacheWarning, match="dump failed"):
        out = generator.generate_sequences(make_prompts())
        SkipManager.flush()
    assert len(out) == 4


def test_a_failed_load_falls_back_to_running_and_replaces_the_entry(tmp_path, generator):
    """An entry that verifies (hashes consistent) but cannot be decoded: warn, run, re-dump."""
    SkipManager.init(run_config(tmp_path, steps=[1]))
    run_steps(generator, [1])
    (entry,) = scan(tmp_path)
    (entry / "data.json").write_text('{"non_tensor_batch": {"x": {"__skip__": "pickle"}}, "meta_info": {}}')
    meta = json.loads((entry / "meta.json").read_text())
    meta["files"]["data.json"] = {
        "bytes": (entry / "data.json").stat().st_size,
        "xxh3_128": file_digest(entry / "data.json"),
    }
    (entry / "meta.json").write_text(json.dumps(meta))

    with pytest.warns(CacheWarning, match="running it instead"):
        (regenerated,) = run_steps(generator, [1])
    (loaded,) = run_steps(generator, [1])
    assert generator.calls == 2
    assert loaded.equals(regenerated)


def test_flush_waits_for_background_dumps(tmp_path, generator):
    SkipManager.init(run_config(tmp_path, steps=list(range(1, 9))))
    for step in range(1, 9):
        SkipManager.set_step(step)
        generator.generate_sequences(make_prompts(n=64, seed=step))
    SkipManager.flush()
    assert steps_on_disk(tmp_path) == list(range(1, 9))


def test_set_step_rejects_non_integers():
    with pytest.raises(TypeError, match="expected an int"):
        SkipManager.set_step("3")


def test_reinit_deactivates_roles_dropped_from_config(tmp_path, generator):
    SkipManager.init(run_config(tmp_path, steps=[1]))
    SkipManager.init({"skip": {}})
    run_steps(generator, [1])
    assert steps_on_disk(tmp_path) == []


def test_threads_dumping_one_step_leave_one_valid_entry(tmp_path):
    # regenerate: a thread that finds another's entry (pending or written) still runs on its own inputs
    SkipManager.init(run_config(tmp_path, steps=[1], on_prompt_mismatch="regenerate"))
    SkipManager.set_step(1)
    generator = Generator()
    results = {}

    def worker(i):
        results[i] = generator.generate_sequences(make_prompts(seed=i))

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    SkipManager.flush()
    for i, out in results.items():  # each thread got the result of its own inputs
        assert torch.equal(out.batch["responses"] // 10, make_prompts(seed=i).batch["input_ids"])
    (entry,) = tmp_path.glob("*/*/1")
    loaded = encoding.read(entry)
    verify(entry)
    assert any(loaded.equals(out) for out in results.values())


def test_a_normal_interpreter_exit_waits_for_pending_dumps(tmp_path):
    script = f"""
import torch
from skip_core import Batch, SkipManager

@SkipManager.annotate(role="rollout")
def generate(prompts):
    return Batch.from_dict({{"responses": torch.rand(256, 32768)}})  # 32 MB: still writing at exit

SkipManager.init({{"skip": {{"rollout": {{"enable": True, "dump_dir": {str(tmp_path)!r}, "steps": [1]}}}}}})
SkipManager.set_step(1)
generate(Batch.from_dict({{"input_ids": torch.zeros(256, 1)}}))
"""
    subprocess.run([sys.executable, "-c", script], check=True, timeout=120)
    (entry,) = scan(tmp_path)
    verify(entry)
    assert encoding.read(entry).batch["responses"].shape == (256, 32768)


def test_a_step_scope_binds_its_context_while_the_clock_moves_on(tmp_path, generator):
    """An overlapped schedule generates step 2 in the background while training step 1."""
    SkipManager.init(run_config(tmp_path, steps=[2]))
    SkipManager.set_step(1)
    started, finish = threading.Event(), threading.Event()
    out = {}

    def background():
        with SkipManager.step_scope(2):
            started.set()
            finish.wait(30)
            out["batch"] = generator.generate_sequences(make_prompts())

    thread = threading.Thread(target=background)
    thread.start()
    started.wait(30)
    SkipManager.set_step(3)  # the loop moves on; the background call still belongs to step 2
    generator.generate_sequences(make_prompts())  # step 3: not listed, never dumped
    finish.set()
    thread.join(30)
    SkipManager.flush()
    assert steps_on_disk(tmp_path) == [2]
    with SkipManager.step_scope(2):
        assert generator.generate_sequences(make_prompts()).equals(out["batch"])
    assert generator.calls == 2


def test_step_scope_rejects_non_integers():
    with pytest.raises(TypeError, match="expected an int"), SkipManager.step_scope("2"):
        pass


def test_stores_gives_the_store_of_each_enabled_role(tmp_path):
    SkipManager.init(run_config(tmp_path))
    stores = SkipManager.stores()
    assert list(stores) == ["rollout"] and stores["rollout"].directory.is_relative_to(tmp_path)

    SkipManager.init(run_config(tmp_path, enable=False))
    assert SkipManager.stores() == {}


def test_each_generation_of_a_step_is_its_own_entry_replayed_in_its_place(tmp_path, generator):
    """DAPO generates several batches in one step: entry 0 keeps verl's layout, the others nest."""
    SkipManager.init(run_config(tmp_path, steps=[1]))
    SkipManager.set_step(1)

    def generations():
        outputs = []
        for index in range(3):
            with SkipManager.generation_scope(index):
                outputs.append(generator.generate_sequences(make_prompts(seed=10 + index)))
        SkipManager.flush()
        return outputs

    first = generations()
    assert generator.calls == 3 and steps_on_disk(tmp_path) == [1]
    nested = sorted(p.relative_to(tmp_path).parts[-2:] for p in tmp_path.rglob("generation_*/1"))
    assert nested == [("generation_1", "1"), ("generation_2", "1")]
    again = generations()
    assert generator.calls == 3  # every generation from its own entry
    assert all(a.equals(b) for a, b in zip(again, first, strict=True))
    assert not first[1].equals(first[2])


def test_generation_scope_rejects_what_is_not_an_index():
    with pytest.raises(TypeError, match="expected an int >= 0"), SkipManager.generation_scope(-1):
        pass
