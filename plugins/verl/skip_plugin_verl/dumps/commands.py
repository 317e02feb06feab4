"""``skip cache import-verl``: verl's pickled dumps converted into verified skip entries."""

from __future__ import annotations

import sys
from pathlib import Path

import click
from skip_core.console import console


def register(cli: click.Group) -> None:
    cli.commands["cache"].add_command(cache_import_verl)


@click.command("import-verl")
@click.argument("src", type=click.Path(exists=True, file_okay=False, path_type=Path))
@click.argument("dst", type=click.Path(file_okay=False, path_type=Path))
@click.option(
    "--trust-pickle",
    is_flag=True,
    help="Required: verl's gen_batch.dp and tq_batch.pt files are pickles, and reading a pickle can run code. "
    "Only convert dumps you made yourself or fully trust.",
)
@click.option(
    "--experiment-name",
    default=None,
    help="verl's trainer.experiment_name, for a {experiment}_{project} directory name that splits more than one way.",
)
@click.option("--project-name", default=None, help="verl's trainer.project_name (see --experiment-name).")
@click.option(
    "--role",
    type=click.Choice(["rollout", "async_rollout"]),
    default="rollout",
    show_default=True,
    help="Role of the gen_batch.dp entries: verl's async_rollout dumps have the same layout, with feed indices "
    "as steps. tq_batch.pt dumps (the V1 trainer's) always become rollout_tq entries.",
)
def cache_import_verl(
    src: Path, dst: Path, trust_pickle: bool, experiment_name: str | None, project_name: str | None, role: str
) -> None:
    """Convert verl's gen_batch.dp and tq_batch.pt dumps under SRC into verified skip entries under DST."""
    if not trust_pickle:
        raise click.UsageError(
            "verl dumps are pickles and can execute code when read; pass --trust-pickle "
            "if you made these files yourself or trust their source"
        )
    from skip_plugin_verl.dumps.importing import import_verl

    written = import_verl(
        src,
        dst,
        # lines quote paths and names read from the dump: never rich markup
        echo=lambda line: console.print(line, markup=False, highlight=False),
        experiment_name=experiment_name,
        project_name=project_name,
        role=role,
    )
    console.print(f"imported {len(written)} entr{'y' if len(written) == 1 else 'ies'} into {dst}", markup=False)
    if written.failed:
        sys.exit(1)
