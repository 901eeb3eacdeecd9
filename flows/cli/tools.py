"""`lanebench tools`: check the inventory and the lanes asked for, then run the tool-gate flow
(flows/tools.py) and print each gate's verdict.

Exit codes (tasks/record/verdict.py): 0 every selected lane passed its gates, 1 a gate failed,
2 bad input, 3 nothing was measured, 130 Ctrl-C or SIGTERM stopped it. The last line names the
run folder.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from flows.cli import _bad_input, run_flow


def _selected(args: argparse.Namespace) -> tuple[Path, list[str]] | str:
    """The inventory and the lanes to run, or the one-line problem with them."""
    from tasks.inventory.models import ConfigError
    from tasks.inventory.load import load_inventory
    from tasks.stages.input_files import check_prompt_files

    hosts = Path(args.hosts)
    try:
        inventory = load_inventory(hosts)
        check_prompt_files(inventory, hosts)
    except ConfigError as e:
        return str(e)
    unknown = [n for n in args.lane or [] if n not in inventory.lanes]
    if unknown:
        return f"--lane {unknown[0]}: no such lane in {hosts}. Fix: use one of: {', '.join(inventory.lanes)}"
    gated = [n for n, lane in inventory.lanes.items() if lane.correctness and lane.correctness.tool_gate]
    names = args.lane or gated
    for name in names:
        if name not in gated:
            return (f"{hosts}: lanes.{name}.correctness.tool_gate: the lane declares no tool gate. "
                    "Fix: add correctness: {tool_gate: {dev: <suite.jsonl>}} (toolsuites/README.md)")
        plan = inventory.lanes[name].correctness.tool_gate  # type: ignore[union-attr]
        if args.held_out and plan is not None and plan.held_out is None:
            return (f"{hosts}: lanes.{name}.correctness.tool_gate.held_out: --held-out asked, but the lane "
                    "declares no held-out suite. Fix: add held_out: <suite.jsonl>, or run without --held-out")
    if not names:
        return f"{hosts}: no lane declares correctness.tool_gate. Fix: add one (toolsuites/README.md)"
    return hosts, names


def cmd_tools(args: argparse.Namespace) -> int:
    selected = _selected(args)
    if isinstance(selected, str):
        return _bad_input(selected)
    hosts, names = selected
    artifacts = Path(args.artifacts).resolve()
    def build() -> Any:
        from flows.tools import tools

        return tools

    state, folder = run_flow("tools", build, artifacts, hosts=str(hosts.resolve()),
                             lanes=names, artifacts_root=str(artifacts), held_out=args.held_out)
    from tasks.record.progress import closing_verdict, say

    if folder:
        from tasks.record.manifest import read_manifest

        for lane, entry in read_manifest(folder).flow.correctness.items():
            for gate in entry.gates:
                colour = "green" if gate.passed else "red"
                say(f"[bold]{lane}[/bold] [{colour}]{gate.gate}[/{colour}]: {gate.detail}")
    return closing_verdict(state, folder, "tools")


def register_cli(subparsers: Any) -> None:
    from tasks.inventory.paths import REPO

    p = subparsers.add_parser("tools", help="tool-call gate: boot each lane with a tool gate, smoke it, grade its suites")
    p.add_argument("--hosts", default=str(REPO / "hosts.yaml"), help="inventory file (default: the shipped hosts.yaml)")
    p.add_argument("--lane", action="append", help="run only this lane (repeatable; default: every lane with a tool gate)")
    p.add_argument("--held-out", action="store_true",
                   help="also run the held-out suite (each run is counted in the manifest)")
    p.add_argument("--artifacts", default=str(REPO / "artifacts"), help="folder that receives the run folder")
    p.set_defaults(func=cmd_tools)
