"""`lanebench matrix FILE`: check the matrix file, then run the drafter matrix flow
(flows/matrix.py) and print each drafter's verdict.

Exit codes: 0 the matrix ran completely, whatever the verdict (`--require-bars`: 1 on a failed
bar), 1 incomplete, 2 bad input, 130 Ctrl-C or SIGTERM stopped it. The last line names the run
folder.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from flows.cli import _bad_input, interrupted_exit, run_flow


def cmd_matrix(args: argparse.Namespace) -> int:
    from tasks.inventory.models import ConfigError
    from tasks.matrix.config import load_matrix

    path = Path(args.file)
    try:
        load_matrix(path)
    except ConfigError as e:
        return _bad_input(str(e))

    from flows.cli import artifacts_arg

    root, artifacts = artifacts_arg(args.artifacts, resolve=True)

    def build() -> Any:
        from flows.matrix import matrix

        return matrix

    state, folder = run_flow("matrix", build, artifacts, matrix_file=str(path.resolve()), artifacts_root=root)
    if (code := interrupted_exit(state, folder, "matrix")) is not None:
        return code
    from tasks.record.manifest import MatrixVerdict, read_manifest
    from tasks.record.progress import closing, say

    matrix = read_manifest(folder).flow.matrix if folder else None
    verdict = (matrix.verdict if matrix else None) or MatrixVerdict(complete=False)
    for name, d in verdict.drafters.items():
        if d["checks"]:
            colour = "green" if d["verdict"] == "PASSED" else "red"
            say(f"drafter [bold]{name}[/bold]: [{colour}]{d['verdict']}[/{colour}] "
                f"({d['passed']} passed, {d['failed']} failed, {d['no_data']} not measured of {d['checks']} checks)")
    if not closing(state, folder, f"matrix complete: {state.message}", "matrix incomplete"):
        return 1
    return 1 if args.require_bars and verdict.bars_failed else 0


def register_cli(subparsers: Any) -> None:
    from tasks.inventory.paths import REPO

    p = subparsers.add_parser("matrix", help="drafter matrix: drafters x K x prompt class, judged against registered bars")
    p.add_argument("file", help="matrix file (e.g. matrix/rehearsal.yaml)")
    p.add_argument("--artifacts", default=str(REPO / "artifacts"), help="folder that receives the run folder")
    p.add_argument("--require-bars", action="store_true",
                   help="exit 1 when any bar fails (default: a failed bar is a verdict, exit 0)")
    p.set_defaults(func=cmd_matrix)
