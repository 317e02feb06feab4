"""``skip diff``: runs and caches written by the real writers (``write_train_data``, ``CacheStore.save``),
compared through ``compare`` and through the command, whose exit status says agree (0), differ (1)
or cannot compare (2)."""

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from safetensors.torch import save_file
from skip_core.batch import Batch
from skip_core.cli import cli
from skip_core.config import Namespace, StepSet
from skip_core.store import CacheStore
from skip_plugin_trainer.diff.compare import TOKENS, compare
from skip_plugin_trainer.diff.sources import DiffError
from skip_plugin_trainer.train.train_data import TrainDataError, read_train_data, train_data_steps, write_train_data

SAMPLES, WIDTH = 4, 8
FLOATS = ("rollout_log_probs", "token_level_scores", "token_level_rewards", "old_log_probs", "advantages", "returns")
NS = Namespace("exp", "proj", SAMPLES, 1, 4, WIDTH)


def step_tensors(step: int) -> dict[str, torch.Tensor]:
    """One step's training data: sample i has WIDTH - i response tokens, the rest padding."""
    g = torch.Generator().manual_seed(step)
    lengths = torch.tensor([WIDTH - i for i in range(SAMPLES)])
    mask = (torch.arange(WIDTH)[None, :] < lengths[:, None]).long()
    out = {"responses": torch.randint(1, 50_000, (SAMPLES, WIDTH), generator=g) * mask, "response_mask": mask}
    for key in FLOATS:
        out[key] = torch.randn(SAMPLES, WIDTH, generator=g) * mask
    return out


def step_metrics(step: int) -> dict[str, float]:
    return {
        "step": step,
        "actor/pg_loss": 0.5 / step,
        "actor/grad_norm": 1.0 + step,
        "actor/entropy": 2.0 - step / 10,
        "critic/score/mean": step / 7,
        # Times and speeds differ from run to run: a fresh value in every run written.
        "timing_s/gen": float(os.urandom(1)[0]),
        "timing_per_token_ms/gen": float(os.urandom(1)[0]),
        "perf/throughput": float(os.urandom(1)[0]),
        "time_to_first_token": float(os.urandom(1)[0]),
    }


def make_run(path: Path, steps=range(1, 6), change=None, metrics_change=None, train_data=True) -> Path:
    """A run directory; ``change(step, tensors)`` and ``metrics_change(step, record)`` edit a step in place."""
    path.mkdir(parents=True, exist_ok=True)
    records = []
    for step in steps:
        if train_data:
            tensors = step_tensors(step)
            if change:
                change(step, tensors)
            write_train_data(path, step, tensors)
        record = step_metrics(step)
        if metrics_change:
            metrics_change(step, record)
        records.append(record)
    (path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def make_cache(root: Path, steps=range(1, 4), change=None) -> Path:
    """A skip cache of the rollout and old_log_prob roles, written by ``CacheStore.save``."""
    rollout, old = CacheStore(root, NS, role="rollout"), CacheStore(root, NS, role="old_log_prob")
    for step in steps:
        tensors = step_tensors(step)
        if change:
            change(step, tensors)
        prompts = torch.ones(SAMPLES, 4, dtype=torch.long)
        rollout.save(
            step,
            Batch.from_dict(
                {
                    "prompts": prompts,
                    "responses": tensors["responses"],
                    "response_mask": tensors["response_mask"],
                    "input_ids": torch.cat([prompts, tensors["responses"]], dim=1),
                    "rollout_log_probs": tensors["rollout_log_probs"],
                },
                {"uid": [f"{step}-{i}" for i in range(SAMPLES)]},
            ),
        )
        old.save(step, Batch({"old_log_probs": tensors["old_log_probs"], "entropys": tensors["rollout_log_probs"]}))
    return root


def nudge(at_step: int, key: str, sample: int, token: int, by: float):
    def change(step, tensors):
        if step == at_step:
            tensors[key][sample, token] += by

    return change


def invoke(*args):
    return CliRunner().invoke(cli, ["diff", *map(str, args)])


def phase(report, name):
    return next(p for p in report.phases if p.name == name)


def assert_one_line(result, *words):
    """An error the user can act on: exit 2, one line naming what is wrong, no traceback."""
    assert result.exit_code == 2, result.output
    lines = result.output.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("Error: "), result.output
    assert "Traceback" not in result.output and all(word in lines[0] for word in words), result.output


def test_identical_runs_agree_on_every_phase_and_exit_0(tmp_path):
    a, b = make_run(tmp_path / "a"), make_run(tmp_path / "b")
    report = compare(a, b)
    assert report.agree and report.steps == [1, 2, 3, 4, 5] and not report.only_a and not report.only_b
    names = [p.name for p in report.phases]
    assert names == [TOKENS, *FLOATS, "losses", "grad norms", "metrics"]  # in the order a step computes them
    masked = sum(WIDTH - i for i in range(SAMPLES))
    assert phase(report, "old_log_probs").compared == 5 * masked  # only the tokens both masks mark
    assert all(p.largest.diff == 0 and p.beyond == 0 for p in report.phases)
    result = invoke(a, b)
    assert result.exit_code == 0, result.output
    assert "A and B agree within atol=1e-05, rtol=0.0001 over steps 1..5 (phases: rollout tokens, " in result.output


def test_a_perturbed_log_prob_is_found_at_its_step_sample_and_token_and_exits_1(tmp_path):
    a = make_run(tmp_path / "a")
    b = make_run(tmp_path / "b", change=nudge(3, "old_log_probs", sample=1, token=4, by=1e-3))
    report = compare(a, b)
    assert not report.agree and report.first.name == "old_log_probs"
    found = report.first.first
    assert (found.step, found.sample, found.token) == (3, 1, 4)
    assert found.diff == pytest.approx(1e-3, rel=1e-3)  # float32 rounding of the nudged value
    assert found.b - found.a == pytest.approx(1e-3, rel=1e-3)
    assert report.first.beyond == 1 and report.first.first_step == 3
    assert [p.name for p in report.phases if p.first_step is not None] == ["old_log_probs"]
    result = invoke(a, b, "--top", 3)
    assert result.exit_code == 1, result.output
    headline = result.output.strip().splitlines()[-1]
    assert headline.startswith("first difference beyond tolerance: step 3, old_log_probs, sample 1 token 4: a=")
    assert "|diff|=0.001" in headline
    assert "old_log_probs: the 1 largest differences" in result.output


def test_a_difference_below_tolerance_passes_and_still_shows_its_size(tmp_path):
    a = make_run(tmp_path / "a")
    b = make_run(tmp_path / "b", change=nudge(3, "advantages", sample=0, token=0, by=2e-6))
    report = compare(a, b)
    assert report.agree
    largest = phase(report, "advantages").largest
    assert (largest.step, largest.sample, largest.token) == (3, 0, 0) and 1e-6 < largest.diff < 3e-6
    assert invoke(a, b).exit_code == 0
    # The same difference fails a tighter tolerance.
    assert not compare(a, b, atol=1e-7, rtol=0).agree
    assert invoke(a, b, "--atol", "1e-7", "--rtol", "0").exit_code == 1


def test_differing_rollout_tokens_are_the_difference_and_their_sample_leaves_the_later_phases(tmp_path):
    def change(step, tensors):
        if step == 2:
            tensors["responses"][3, 0] += 1
            tensors["old_log_probs"][3, 1] += 5.0  # of other tokens: not compared
            tensors["token_level_scores"][3, 2] += 5.0

    a, b = make_run(tmp_path / "a"), make_run(tmp_path / "b", change=change)
    report = compare(a, b)
    assert report.first.name == TOKENS
    tokens = report.first
    assert (tokens.first.step, tokens.first.sample, tokens.first.token) == (2, 3, 0) and tokens.beyond == 1
    assert tokens.first.b == tokens.first.a + 1
    old = phase(report, "old_log_probs")
    assert old.first is None and old.left_out == 1
    masked = sum(WIDTH - i for i in range(SAMPLES))
    assert old.compared == 5 * masked - (WIDTH - 3)  # sample 3 of step 2 left out
    result = invoke(a, b)
    assert result.exit_code == 1
    assert "first difference beyond tolerance: step 2, rollout tokens, sample 3 token 0: a=" in result.output


def test_a_response_present_on_one_side_only_is_a_rollout_difference(tmp_path):
    def longer(step, tensors):
        if step == 4:
            tensors["response_mask"][3, WIDTH - 3] = 1  # sample 3 has one token more

    report = compare(make_run(tmp_path / "a"), make_run(tmp_path / "b", change=longer))
    found = report.first.first
    assert report.first.name == TOKENS and (found.step, found.sample, found.token) == (4, 3, WIDTH - 3)


def test_a_differing_grad_norm_is_reported_and_timings_are_ignored(tmp_path):
    def grad(step, record):
        if step == 4:
            record["actor/grad_norm"] += 0.01

    a, b = make_run(tmp_path / "a"), make_run(tmp_path / "b", metrics_change=grad)
    report = compare(a, b)
    assert report.first.name == "grad norms"
    assert (report.first.first.step, report.first.first.metric) == (4, "actor/grad_norm")
    assert report.first.first.diff == pytest.approx(0.01)
    assert phase(report, "losses").compared == 5 and phase(report, "metrics").compared == 5 * 2  # entropy, score
    result = invoke(a, b)
    assert result.exit_code == 1
    assert "first difference beyond tolerance: step 4, grad norms, actor/grad_norm: a=5, b=5.01" in result.output
    assert "timing" not in result.output and "perf/" not in result.output and "time_to" not in result.output


def test_ignored_metrics_are_left_out_and_engine_counters_always_are(tmp_path):
    """A diagnostic averaged over micro-batches moves when their split does (rollout_corr/* of
    bypass mode with another number of actor workers); --ignore leaves it out, nothing else."""

    def diagnostics(step, record):
        record["rollout_corr/chi2_token"] = 1e-4 * step
        record["rollout/engine/decode_rows"] = float(os.urandom(1)[0])  # how requests met in the engine

    def moved(step, record):
        diagnostics(step, record)
        record["rollout_corr/chi2_token"] += 1e-3

    a, b = make_run(tmp_path / "a", metrics_change=diagnostics), make_run(tmp_path / "b", metrics_change=moved)
    assert compare(a, b).first.first.metric == "rollout_corr/chi2_token"
    report = compare(a, b, ignore=["rollout_corr/*"])
    assert report.agree and phase(report, "metrics").compared == 5 * 2  # entropy and score still compared
    assert invoke(a, b, "--ignore", "rollout_corr/*").exit_code == 0
    assert invoke(a, b).exit_code == 1


def test_steps_on_one_side_only_are_named(tmp_path):
    a, b = make_run(tmp_path / "a", steps=range(1, 21)), make_run(tmp_path / "b", steps=range(1, 19))
    report = compare(a, b)
    assert report.agree and report.steps == list(range(1, 19)) and report.only_a == [19, 20] and not report.only_b
    result = invoke(a, b)
    assert result.exit_code == 0 and "steps only in A: 19..20" in result.output


def test_steps_restricts_the_comparison(tmp_path):
    a = make_run(tmp_path / "a")
    b = make_run(tmp_path / "b", change=nudge(3, "returns", sample=2, token=1, by=1.0))
    assert compare(a, b, steps=StepSet([(1, 2)])).steps == [1, 2]
    assert compare(a, b, steps=StepSet([(1, 2)])).agree
    assert invoke(a, b, "--steps", "1..2,4..5").exit_code == 0
    assert invoke(a, b, "--steps", "2..3").exit_code == 1
    assert invoke(a, b, "--steps", "7..9").exit_code == 2  # nothing in common
    assert invoke(a, b, "--steps", "5..1").exit_code == 2  # click's usage error


def test_two_caches_are_compared_role_by_role(tmp_path):
    a = make_cache(tmp_path / "a")
    b = make_cache(tmp_path / "b", change=nudge(2, "old_log_probs", sample=0, token=5, by=1e-3))
    report = compare(a, b / "exp_proj")  # a dump_dir against a run's directory in one
    assert [p.name for p in report.phases] == [TOKENS, "rollout_log_probs", "old_log_probs"]
    assert report.steps == [1, 2, 3]
    found = report.first.first
    assert report.first.name == "old_log_probs" and (found.step, found.sample, found.token) == (2, 0, 5)
    assert compare(a, tmp_path / "a" / "exp_proj" / NS.shape).agree  # the rollout role's GBS directory alone
    assert invoke(a, b).exit_code == 1
    assert invoke(a, a / "exp_proj").exit_code == 0


def test_a_dump_dir_of_several_runs_asks_for_one(tmp_path):
    a = make_cache(tmp_path / "a")
    CacheStore(a, Namespace("other", "proj", SAMPLES, 1, 4, WIDTH), role="rollout").save(1, Batch({"x": torch.ones(2)}))
    result = invoke(a, a)
    assert_one_line(result, "holds the caches of several runs", f"exp_proj/{NS.shape}", f"other_proj/{NS.shape}")
    assert invoke(a / "exp_proj", a / "exp_proj").exit_code == 0  # one of them named


def test_a_cache_compares_with_a_run(tmp_path):
    run, cache = make_run(tmp_path / "run", steps=range(1, 4)), make_cache(tmp_path / "cache")
    report = compare(run, cache)
    assert report.agree and [p.name for p in report.phases] == [TOKENS, "rollout_log_probs", "old_log_probs"]


def test_responses_of_other_widths_compare_on_the_common_width_unless_tokens_lie_beyond(tmp_path):
    a = make_run(tmp_path / "a", steps=[1])
    wide = {key: torch.nn.functional.pad(t, (0, 4)) for key, t in step_tensors(1).items()}  # more padding
    write_train_data(tmp_path / "b", 1, wide)
    assert compare(a, tmp_path / "b").agree
    wide["response_mask"][0, WIDTH] = 1
    write_train_data(tmp_path / "b", 1, wide)
    report = compare(a, tmp_path / "b")
    assert not report.agree and report.first.name == TOKENS
    assert report.first.shapes[0] == (1, f"A [{SAMPLES}, {WIDTH}], B [{SAMPLES}, {WIDTH + 4}]")
    assert "step 1, rollout tokens: shapes differ" in report.headline()


def test_nan_agrees_with_nan_and_differs_from_a_number(tmp_path):
    def values(first: float):
        def change(step, tensors):
            tensors["values"] = torch.zeros(SAMPLES, WIDTH)
            tensors["values"][0, 0] = first

        return change

    a, b = make_run(tmp_path / "a", change=values(math.nan)), make_run(tmp_path / "b", change=values(math.nan))
    assert compare(a, b).agree
    report = compare(a, make_run(tmp_path / "c", change=values(0.0)))
    assert report.first.name == "values" and report.first.first.diff == math.inf and report.first.beyond == 5


def test_a_corrupt_cache_entry_is_one_line_naming_it(tmp_path):
    a, b = make_cache(tmp_path / "a"), make_cache(tmp_path / "b")
    entry = b / "exp_proj" / "old_log_prob" / NS.shape / "2"
    data = bytearray((entry / "tensors.safetensors").read_bytes())
    data[len(data) // 2] ^= 0xFF
    (entry / "tensors.safetensors").write_bytes(bytes(data))
    with pytest.raises(DiffError, match="does not match its recorded hash"):
        compare(a, b)
    assert_one_line(invoke(a, b), str(entry), "does not match its recorded hash")
    assert invoke(a, b, "--steps", "1,3").exit_code == 0  # the other steps are sound


def test_a_symlinked_train_data_file_is_refused_in_one_line(tmp_path):
    a, b = make_run(tmp_path / "a"), make_run(tmp_path / "b")
    target = b / "train_data" / "step_2.safetensors"
    os.replace(target, tmp_path / "elsewhere.safetensors")
    target.symlink_to(tmp_path / "elsewhere.safetensors")
    assert_one_line(invoke(a, b), str(target), "is a symbolic link")


def test_a_path_that_is_no_run_nor_cache_is_one_line_through_the_skip_command(tmp_path):
    a = make_run(tmp_path / "a")
    (tmp_path / "empty").mkdir()
    skip = Path(sys.executable).parent / "skip"
    for other, words in [
        (tmp_path / "empty", "neither a run directory"),
        (tmp_path / "missing", "no such directory"),
        (a / "metrics.jsonl", "no such directory"),
    ]:
        done = subprocess.run([skip, "diff", a, other], capture_output=True, text=True, timeout=120)
        assert done.returncode == 2, done.stderr
        lines = done.stderr.strip().splitlines()
        assert len(lines) == 1 and str(other) in lines[0] and words in lines[0], done.stderr
        assert "Traceback" not in done.stderr and not done.stdout


def test_runs_with_nothing_in_common_are_one_line(tmp_path):
    a, b = make_run(tmp_path / "a", steps=[1, 2, 3]), make_run(tmp_path / "b", steps=[5, 6])
    assert_one_line(invoke(a, b), "nothing in common to compare", "has steps 1..3", "has 5..6")


def test_metrics_only_runs_compare_their_metrics(tmp_path):
    a = make_run(tmp_path / "a", train_data=False)
    b = make_run(tmp_path / "b", train_data=False)
    with (b / "metrics.jsonl").open("a") as f:
        f.write('{"step": 6, "actor/pg_loss": 0.1')  # a line cut by a crash
    report = compare(a, b)
    assert report.agree and [p.name for p in report.phases] == ["losses", "grad norms", "metrics"]
    assert any("1 line without a step's metrics skipped" in note for note in report.notes)
    assert report.metrics_only
    first_line = invoke(a, b).output.splitlines()[0]
    assert first_line.startswith("metrics only: no step has per-token training data on both sides; runs with")
    assert not invoke(make_run(tmp_path / "c"), make_run(tmp_path / "d")).output.startswith("metrics only")


def test_train_data_round_trips_atomically_and_refuses_what_it_did_not_write(tmp_path):
    tensors = step_tensors(7)
    tensors["advantages"] = tensors["advantages"].t().contiguous().t()  # not contiguous: written all the same
    path = write_train_data(tmp_path, 7, tensors)
    assert path == tmp_path / "train_data" / "step_7.safetensors"
    assert os.listdir(tmp_path / "train_data") == ["step_7.safetensors"]  # no temporary file left
    back = read_train_data(path)
    assert back.keys() == tensors.keys() and all(torch.equal(back[k], tensors[k]) for k in tensors)
    assert train_data_steps(tmp_path) == [7]

    foreign = tmp_path / "train_data" / "step_8.safetensors"
    save_file({"x": torch.zeros(2, 2)}, str(foreign), metadata={"format": "other"})
    with pytest.raises(TrainDataError, match="format 'other'"):
        read_train_data(foreign)
    renamed = tmp_path / "train_data" / "step_9.safetensors"
    os.replace(path, renamed)
    with pytest.raises(TrainDataError, match="records step '7'"):
        read_train_data(renamed)
    (tmp_path / "train_data" / "step_010.safetensors").write_bytes(b"")
    os.mkfifo(tmp_path / "train_data" / "step_11.safetensors")
    assert train_data_steps(tmp_path) == [8, 9, 11]  # names only; step_010 is no name skip writes
    with pytest.raises(TrainDataError, match="not a regular file"):
        read_train_data(tmp_path / "train_data" / "step_11.safetensors")


def sparse_train_data(run: Path, rows: int, width: int, keys=("responses", "old_log_probs", "advantages")) -> int:
    """A run whose step 1 file declares ``rows`` x ``width`` of each key (int64 responses, float32
    others) in a file that is one hole: kilobytes on disk, and the size it declares. Its bytes."""
    header, offset = {}, 0
    for key in keys:
        dtype, size = ("I64", 8) if key == "responses" else ("F32", 4)
        header[key] = {"dtype": dtype, "shape": [rows, width], "data_offsets": [offset, offset + rows * width * size]}
        offset += rows * width * size
    header["__metadata__"] = {"format": "skip-train-data", "version": "1", "step": "1"}
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    (run / "train_data").mkdir(parents=True)
    with open(run / "train_data" / "step_1.safetensors", "wb") as out:
        out.write(len(text).to_bytes(8, "little") + text)
        out.truncate(8 + len(text) + offset)
    return 8 + len(text) + offset


_PEAK = """
import json, resource, sys
from skip_plugin_trainer.diff.compare import compare
peak = lambda: resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
before = peak()
report = compare(sys.argv[1], sys.argv[2])
print(json.dumps({"agree": report.agree, "grown": peak() - before}))
"""


def test_comparing_a_step_costs_about_its_bytes_not_many_times_them(tmp_path):
    """No mask: every token is compared, as float64, with its differences; chunk by chunk."""
    size = sum(sparse_train_data(tmp_path / side, 1600, 8192) for side in "ab")
    code = [sys.executable, "-c", _PEAK, str(tmp_path / "a"), str(tmp_path / "b")]
    result = json.loads(subprocess.run(code, capture_output=True, text=True, check=True).stdout)
    assert result["agree"]
    assert result["grown"] < 1.5 * size  # the tensors once, and chunks; was 4.6 times them (1.85 GB for 0.4 GB)


def test_a_step_larger_than_half_the_available_memory_is_refused_before_it_is_read(tmp_path, monkeypatch):
    from skip_plugin_trainer.diff import compare

    # The machine's free memory moves while other tests run: the budget it gives is fixed here.
    budget = 256 * 2**20
    monkeypatch.setattr(compare, "memory_budget", lambda: budget)
    rows = budget // (2 * 8192 * 8) + 1  # responses alone, on each side: together past the budget
    for side in "ab":
        sparse_train_data(tmp_path / side, rows, 8192, keys=("responses",))
    result = CliRunner().invoke(cli, ["diff", str(tmp_path / "a"), str(tmp_path / "b")])
    assert result.exit_code == 2
    (line,) = result.output.splitlines()
    assert line.startswith("Error: step 1: A's and B's tensors take ")
    assert line.endswith(
        f"more than half the memory available ({budget / 2**30:.1f} GiB); compare on a machine with more memory"
    )
