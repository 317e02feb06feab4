"""Every ``skip`` command the READMEs and the docs show, in a code block or inline in the prose,
run in its dry form: ``skip run`` and ``skip rollout`` under ``--check``, ``skip simulate`` under
``--check``, and the commands that read directories (``diff``, ``profile``, ``cache``) parsed by
their own parser, with the directories they name in place. An example that stops working fails
here. An inline command that only names a command (``skip profile report``) or shows its form
with placeholders (``skip profile trace DIR [-o FILE]``, ``skip run ...``) must name one that
exists."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest
from click.testing import CliRunner
from skip_core.cli import cli
from skiptests import ROOT

PAGES = [ROOT / "README.md", ROOT / "CONTRIBUTING.md", *sorted((ROOT / "docs").glob("*.md"))]
PAGES += sorted((ROOT / "plugins").glob("*/README.md"))
# The commands the docs show as refusals: the start of their one error line. Every other one
# validates, a GPU machine's too (``--check`` plans it without the devices).
REFUSED = {
    "skip run --check algorithm.kl_ctrl.type=adaptive": "Error: algorithm.kl_ctrl.type: not implemented",
}


def documented() -> list[tuple[str, str]]:
    """``(page, command)`` for each ``skip`` command in a fenced block: continuations joined,
    ``# comments`` and ``$ `` prompts dropped, ``a && b`` two commands."""
    found = []
    for page in PAGES:
        for block in re.findall(r"```[a-z]*\n(.*?)```", page.read_text(), re.S):
            for line in block.replace("\\\n", " ").splitlines():
                line = line.strip().removeprefix("$ ").split("  #")[0].strip()
                for command in line.split(" && "):
                    if re.match(r"^(\w+=\S+ )*(\.venv/bin/)?skip ", command.strip()):
                        found.append((page.relative_to(ROOT).as_posix(), " ".join(command.split())))
    return found


def inline() -> tuple[list[tuple[str, str]], list[tuple[str, str]]]:
    """``(page, command)`` for each inline ``skip`` command in the prose: those complete enough to
    run, and those that only name a command or show its form."""
    runnable, named = [], []
    for page in PAGES:
        prose = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)
        for span in re.findall(r"`((?:\.venv/bin/)?skip [^`]*)`", prose):
            command = " ".join(span.split())
            words = command.split()[1:]
            # ``...``, ``<yours>``, ``[--step K]``, ``report|trace``, ``steps=a..b``, ``rollout.backend=B``
            placeholder = re.search(r"\.\.\.|<|\[|\||\ba\.\.b\b|=[A-Z]+\b(?!/)", command) or command in MENTIONS
            bare = all(re.fullmatch(r"[a-z][a-z-]*", word) for word in words)  # ``skip cache verify``
            (named if placeholder or bare else runnable).append((page.relative_to(ROOT).as_posix(), command))
    return list(dict.fromkeys(runnable)), list(dict.fromkeys(named))


# Inline commands that show an option in a heading, not a command to run.
MENTIONS = {"skip cache import-verl --trust-pickle"}
COMMANDS = documented()
INLINE, NAMED = inline()


def test_the_docs_show_commands_of_every_kind():
    kinds = {
        shlex.split(command)[shlex.split(command).index("skip") + 1] for _, command in COMMANDS if "skip" in command
    }
    assert {"run", "simulate", "diff", "profile", "cache", "plugins"} <= kinds


def test_the_prose_shows_commands_to_run_and_names_commands():
    assert len(INLINE) >= 10 and len(NAMED) >= 50


@pytest.mark.parametrize(("page", "command"), NAMED, ids=[f"{p}: {c}" for p, c in NAMED])
def test_a_command_the_prose_names_exists(page, command):
    group, context = cli, cli.make_context("skip", ["plugins"])
    for word in command.split()[1:]:
        if not re.fullmatch(r"[a-z][a-z-]*", word) or not hasattr(group, "get_command"):
            break
        group = group.get_command(context, word)
        assert group is not None, f"{page}: {command}: skip has no command {word!r}"


@pytest.mark.parametrize(("page", "command"), COMMANDS + INLINE, ids=[f"{p}: {c}" for p, c in COMMANDS + INLINE])
def test_a_documented_command_works_in_its_dry_form(page, command, task_dir, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "configs").symlink_to(ROOT / "configs")  # the experiment config the docs start from
    monkeypatch.setenv("WANDB_MODE", "disabled")
    words = shlex.split(command)
    args = words[words.index("skip") + 1 :]  # without VAR=value prefixes and the venv's path
    args = [_local(arg, tmp_path) for arg in args]
    kind = args[0]
    if kind in ("run", "rollout"):
        (tmp_path / "runs").mkdir(exist_ok=True)
        (tmp_path / "runs" / "embedded").symlink_to(task_dir)  # the default task, built once per session
        result = CliRunner().invoke(cli, [kind, *(["--check"] if "--check" not in args else []), *args[1:]])
        expected = REFUSED.get(command)
        if expected is None:
            assert result.exit_code == 0, f"{page}: {command}\n{result.output}"
        else:
            assert result.exit_code == 1 and result.output.splitlines()[-1].startswith(expected), result.output
            assert "Traceback" not in result.output
        return
    if kind == "simulate" and "--from-profile" not in args:
        result = CliRunner().invoke(cli, [*args, "--check"])
        assert result.exit_code == 0 and re.search(r"\d+ runs: ", result.output), f"{page}: {command}\n{result.output}"
        return
    if kind == "plugins":
        assert CliRunner().invoke(cli, args).exit_code == 0
        return
    _parsed(args, tmp_path)


def _local(arg: str, tmp_path: Path) -> str:
    """A directory an example names outside the working directory (``/nfs/run``), moved into it."""
    for prefix in ("/nfs/", "/tmp/", "/models/"):
        if arg.startswith(prefix):
            return str(tmp_path / arg.lstrip("/"))
    return arg


def _parsed(args: list[str], tmp_path: Path) -> None:
    """``args`` parsed by their command's own parser (options, types, arguments), the directories
    they name created first: reading them is not the point."""
    for arg in args:
        if ("/" in arg or arg.isupper()) and not arg.startswith("-") and "=" not in arg:  # OLD_DUMP_DIR too
            (tmp_path / arg).mkdir(parents=True, exist_ok=True)
    group, words = cli, list(args)
    context = cli.make_context("skip", list(args))
    while words:
        sub = group.get_command(context, words[0])
        assert sub is not None, f"skip has no command {' '.join(args)}"
        context = sub.make_context(words[0], words[1:], parent=context)
        if not hasattr(sub, "get_command"):
            return
        group, words = sub, context.protected_args + context.args
