from skip_core.cli import cli

cli()
