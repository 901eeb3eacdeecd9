"""`python -m flows.cli`: the `lanebench` command without the installed script."""

from flows.cli import run

run()
