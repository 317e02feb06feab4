"""What every installed role must satisfy, whichever distribution provides it: found the way the
core finds it (the ``skip`` entry points, ``skip_core.plugins.registry``), a ``skip.<role>``
section that validates with one-line errors and stays off unless enabled, and through the real
manager and store an exact replay of what it dumped, never of a spoiled or foreign entry.

A role's own rule (its settings, how it reads its step) is tested beside it, in its plugin's tests.
"""

import inspect
import json
import re

import numpy as np
import pytest
import tomllib
import torch
from skip_core import Batch, ConfigError, Role, RoleConfig, SkipManager
from skip_core import plugins as plugin_loading
from skip_core.config import install_hint
from skip_core.entries import META, scan, verify
from skip_core.plugins import distribution, pm, registry
from skip_core.roles import Call
from skip_core.sections import parse_roles
from skip_core.store import CacheWarning
from skiptests import NS, ROOT, corrupt_one_byte, run_config

ROLES = sorted(registry().roles)
# The folder of this repository that holds each distribution, by its name.
FOLDERS = {
    tomllib.loads(path.read_text())["project"]["name"]: path.parent.relative_to(ROOT)
    for path in ROOT.glob("plugins/*/pyproject.toml")
}


def provider(name: str) -> str:
    """The distribution that registered role ``name``."""
    return distribution(registry().provider[("roles", name)])


class Computation:
    """A decorated function of one role. Its results depend on its inputs and on how many times
    its body ran, and hold every kind of data a batch carries, so a replay is told from a run."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.runs = 0

        @SkipManager.annotate(role=name)
        def compute(prompts: Batch) -> Batch:
            self.runs += 1
            g = torch.Generator().manual_seed(self.runs)
            n = len(prompts)
            return Batch.from_dict(
                {
                    "ids": prompts.batch["input_ids"] * 10 + self.runs,
                    "scores": torch.randn(n, 3, generator=g),
                    "values": torch.randn(n, 3, generator=g).bfloat16(),
                },
                {"uid": prompts.non_tensor_batch["uid"], "turns": [{"n": i, "tools": ["calc"]} for i in range(n)]},
                {"role": name, "run": self.runs},
            )

        self.compute = compute

    def step(self, prompts: Batch) -> int:
        """The step a call with ``prompts`` is made at: trainer step 1, set here, or the step an
        online role reads from the call (verl's sample id ``sample_{epoch}_{index}`` in ``uid``)."""
        role = registry().roles[self.name]
        if not role.online_step:
            SkipManager.set_step(1)
            return 1
        call = Call(self.compute, (prompts,), {}, inspect.signature(self.compute))
        step = pm.hook.skip_resolve_step(role=role, config=role.config(), call=call)
        assert isinstance(step, int), f"online role {self.name!r} reads no step from a call with uid sample_0_1"
        return step


def sample() -> Batch:
    """Two rows of one sample, ``sample_0_1``."""
    uid = np.array(["sample_0_1"] * 2, dtype=object)
    return Batch.from_dict({"input_ids": torch.arange(8).reshape(2, 4)}, {"uid": uid})


def enabled(tmp_path, name: str) -> tuple[Computation, int]:
    """A computation of role ``name``, the role enabled (``action=cache``) on the step of its call."""
    computation = Computation(name)
    step = computation.step(sample())
    SkipManager.init(run_config(tmp_path, role=name, steps=[step]))
    return computation, step


@pytest.mark.parametrize("name", ROLES)
def test_the_core_says_which_distribution_of_the_repository_to_install_for_it(name):
    dist = provider(name)
    assert dist in FOLDERS, f"role {name!r} comes from {dist}, which is no distribution of this repository"
    hint = install_hint("role", name)
    assert hint.startswith(f"install {dist} ") and hint.endswith(f"pip install ./{FOLDERS[dist]}"), hint


@pytest.mark.parametrize("name", ROLES)
def test_its_distribution_alone_registers_it_through_its_declared_entry_point(name, monkeypatch):
    dist = provider(name)
    entry_point = registry().provider[("roles", name)]
    project = tomllib.loads((ROOT / FOLDERS[dist] / "pyproject.toml").read_text())["project"]
    declared = project["entry-points"]["skip"]
    assert entry_point in declared, f"{dist} is installed with entry point {entry_point!r}, its pyproject: {declared}"
    try:
        with monkeypatch.context() as patch:
            patch.setenv("SKIP_PLUGINS", dist)
            plugin_loading._reset_for_tests()
            alone = registry()
            providers = {distribution(plugin) for (kind, _), plugin in alone.provider.items() if kind == "roles"}
    finally:
        plugin_loading._reset_for_tests()  # the plugins of the session again
    assert isinstance(alone.roles.get(name), Role) and alone.roles[name].name == name
    assert providers == {dist}


@pytest.mark.parametrize("name", ROLES)
def test_its_section_is_off_unless_enabled_and_takes_the_keys_of_every_role(name, tmp_path):
    role = registry().roles[name]
    absent = parse_roles({})[name]
    assert type(absent) is role.config and issubclass(role.config, RoleConfig)
    assert absent.enable is False and not absent.steps
    given = parse_roles({name: {"enable": True, "steps": [2, "4..5"], "dump_dir": tmp_path}})[name]
    assert (given.enable, list(given.steps), given.dump_path) == (True, [2, 4, 5], str(tmp_path))


@pytest.mark.parametrize(
    ("setting", "error"),
    [
        ({"stpes": [1]}, r"stpes: unknown key \(allowed: .*\); did you mean skip\.{name}\.steps\?"),
        ({"enable": "maybe"}, r"enable: expected true or false, got 'maybe'"),
        ({"steps": [1, "x"]}, r"steps\[1\]: expected an integer, got 'x'"),
    ],
    ids=["unknown key", "bad value", "bad step"],
)
@pytest.mark.parametrize("name", ROLES)
def test_a_bad_setting_is_one_line_naming_its_key(name, setting, error):
    with pytest.raises(ConfigError) as raised:
        parse_roles({name: setting})
    assert re.fullmatch(rf"skip\.{name}\.{error.format(name=name)}", str(raised.value)), str(raised.value)


@pytest.mark.parametrize("name", ROLES)
def test_a_dumped_result_replays_exactly_in_a_later_run(name, tmp_path):
    computation, step = enabled(tmp_path, name)
    first = computation.compute(sample())
    SkipManager.flush()

    (entry,) = scan(tmp_path)
    assert entry == SkipManager.stores()[name].path(step)
    assert verify(entry, role=name, namespace=NS)["role"] == name
    SkipManager.reset()  # a later run, on the same dump_dir
    computation.step(sample())  # sets the trainer step again, which the reset forgot
    SkipManager.init(run_config(tmp_path, role=name, steps=[step]))
    replayed = computation.compute(sample())

    assert computation.runs == 1
    assert replayed.equals(first) and replayed.batch["values"].dtype == torch.bfloat16


@pytest.mark.parametrize("name", ROLES)
def test_a_call_on_an_unlisted_step_runs_and_dumps_nothing(name, tmp_path):
    computation = Computation(name)
    step = computation.step(sample())
    SkipManager.init(run_config(tmp_path, role=name, steps=[step + 1]))
    computation.compute(sample())
    SkipManager.flush()
    computation.compute(sample())
    SkipManager.flush()
    assert computation.runs == 2
    assert list(scan(tmp_path)) == []


def flip_a_byte(entry) -> str:
    corrupt_one_byte(entry / "tensors.safetensors")
    return "tensors.safetensors does not match its recorded hash"


def claim_another_role(entry) -> str:
    meta = json.loads((entry / META).read_text())
    role, meta["role"] = meta["role"], "judge"
    (entry / META).write_text(json.dumps(meta))
    return f"written for role 'judge', not '{role}'"


@pytest.mark.parametrize("spoil", [flip_a_byte, claim_another_role])
@pytest.mark.parametrize("name", ROLES)
def test_a_spoiled_entry_is_refused_naming_it_and_the_call_runs(name, spoil, tmp_path):
    computation, _ = enabled(tmp_path, name)
    computation.compute(sample())
    SkipManager.flush()
    (entry,) = scan(tmp_path)
    reason = spoil(entry)

    with pytest.warns(CacheWarning, match=re.escape(f"ignoring cache entry {entry}: {reason}")):
        again = computation.compute(sample())
    SkipManager.flush()

    assert computation.runs == 2 and again.meta_info["run"] == 2
    assert computation.compute(sample()).equals(again)  # its dump replaced the spoiled entry
    assert computation.runs == 2


def test_roles_sharing_a_dump_dir_each_replay_their_own_results(tmp_path):
    computations = [Computation(name) for name in ROLES]
    config = run_config(tmp_path)
    config["skip"] = {c.name: {"enable": True, "dump_dir": tmp_path, "steps": [c.step(sample())]} for c in computations}
    SkipManager.init(config)
    first = [c.compute(sample()) for c in computations]
    SkipManager.flush()

    replayed = [c.compute(sample()) for c in computations]

    assert [c.runs for c in computations] == [1] * len(ROLES)
    assert [r.meta_info["role"] for r in replayed] == ROLES
    assert all(r.equals(f) for r, f in zip(replayed, first, strict=True))
    assert len({store.directory for store in SkipManager.stores().values()}) == len(ROLES)
