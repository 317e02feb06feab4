import pytest
import torch
from skip_core import Batch, ConfigError, SkipManager
from skip_core.store import scan

ROLE = "reward"


@pytest.fixture(autouse=True)
def fresh_manager():
    SkipManager.reset()
    yield
    SkipManager.reset()


@pytest.fixture
def dump_dir(tmp_path):
    """The role enabled with ``action=cache`` on step 1 only, dumping to tmp_path."""
    config = {
        "enable": True,
        "dump_dir": str(tmp_path),
        "steps": [1],
        "action": "cache",
    }
    SkipManager.init({"skip": {ROLE: config}})
    return tmp_path


def counted():
    """A function of the role, and the list of the calls that really ran its body."""
    runs = []

    @SkipManager.annotate(role=ROLE)
    def compute(prompts: Batch) -> Batch:
        runs.append(prompts)
        scores = prompts.batch["input_ids"].sum(-1, keepdim=True).float()
        uid = prompts.non_tensor_batch["uid"]
        return Batch.from_dict({"scores": scores}, {"uid": uid})

    return compute, runs


def make_prompts() -> Batch:
    input_ids = torch.arange(6).reshape(2, 3)
    return Batch.from_dict({"input_ids": input_ids}, {"uid": ["a", "b"]})


def test_listed_step_is_served_from_cache_the_second_time(dump_dir):
    compute, runs = counted()
    SkipManager.set_step(1)

    first = compute(make_prompts())
    SkipManager.flush()
    second = compute(make_prompts())

    assert len(runs) == 1
    assert second.equals(first)


def test_unlisted_step_runs_every_time_and_caches_nothing(dump_dir):
    compute, runs = counted()
    SkipManager.set_step(2)

    compute(make_prompts())
    SkipManager.flush()
    compute(make_prompts())
    SkipManager.flush()

    assert len(runs) == 2
    assert list(scan(dump_dir)) == []


def test_a_score_is_never_replayed_for_other_responses(tmp_path):
    """The entry's fingerprint covers the responses: other responses at a cached step are scored
    again, and the role refuses the warn-and-load that other roles allow."""
    SkipManager.init({"skip": {ROLE: {"enable": True, "dump_dir": str(tmp_path), "steps": [1]}}})
    compute, runs = counted()
    SkipManager.set_step(1)
    compute(make_prompts())
    SkipManager.flush()
    other = make_prompts()
    other.batch["input_ids"][0, -1] += 1  # another response to the same prompt
    rescored = compute(other)
    assert len(runs) == 2 and rescored.batch["scores"][0].item() == other.batch["input_ids"][0].sum().item()
    with pytest.raises(ConfigError, match="on_prompt_mismatch"):
        SkipManager.init({"skip": {ROLE: {"enable": True, "dump_dir": str(tmp_path), "on_prompt_mismatch": "warn"}}})
