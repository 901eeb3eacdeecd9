"""`lanebench tools`: the tool-call gate on demand, on a freshly booted lane.

    preflight -> boot -> boot gates (declared, agentic smoke, thinking switch)
              -> tool gate: dev suite [+ held-out suite with --held-out] -> report   (teardown always)

The nightly runs the dev suite on every lane that declares a tool gate; this command runs it
alone (minutes instead of a whole night) and is the only way to run the held-out suite, so a
held-out score is never looked at by accident. Every held-out run is counted in the manifest
(`flow.correctness.<lane>.tool_gate.held_out.run_number`, with the earlier runs found under
the same artifacts folder).

Exit codes (tasks/record/verdict.py): 0 every selected lane passed its gates, 1 a gate failed,
2 bad input, 3 nothing was measured (every lane skipped by a precondition: not a pass), 130
Ctrl-C or SIGTERM stopped it (lane torn down, run folder marked interrupted). The last line
names the run folder. This module stays cheap to import: Prefect is imported on first use of
the flow (`tools`, built lazily).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

_flow: Any = None


def run_tools(hosts: str, lanes: list[str], artifacts_root: str = "artifacts", held_out: bool = False) -> Any:
    """The flow body: each named lane booted under its host lock, tool gate run, report written."""
    from prefect.runtime import flow_run
    from prefect.states import Completed, Failed

    from flows.lanes import LaneJob, run_lanes
    from tasks.record.interrupted import interrupts, record_stop
    from tasks.record.verdict import STATE_NAMES, night_verdict
    from tasks.correctness import record as correctness
    from tasks.record.run_folder import RunFolder
    from tasks.inventory.load import load_inventory
    from tasks.record.report import render

    inventory_path = Path(hosts).resolve()
    inventory = load_inventory(inventory_path)
    run = RunFolder(Path(artifacts_root), "tools", str(flow_run.get_id()), inventory_path)
    run.manifest.flow["held_out_requested"] = held_out
    stopped = ""
    try:
        run_lanes(run, [LaneJob(name=name, lane=inventory.lanes[name], host=inventory.hosts[inventory.lanes[name].host],
                                base_dir=str(inventory_path.parent), stages="tools", held_out=held_out,
                                inventory=inventory) for name in lanes])
    except interrupts() as e:
        stopped = record_stop(run, "tools", e, lanes)
    finally:
        run.finish()
        if not stopped:  # a stopped run ends within seconds: the manifest and records are the record
            report = render(run)
            for name in run.manifest.lanes:
                report += "\n" + "\n".join(correctness.section(run, name)) + "\n"
            (run.path / "report.md").write_text(report)
            run.register("", "report.md", "report")
    if stopped:
        return Failed(name="Interrupted", message=stopped)
    verdict = night_verdict("tools", run.manifest.lanes, [])
    run.manifest.flow["verdict"] = {"outcome": verdict.outcome, "exit_code": verdict.exit_code, "line": verdict.line}
    run.save_manifest()
    if verdict.outcome == "failed":
        return Failed(message=verdict.line)
    return Completed(name=STATE_NAMES[verdict.outcome], message=verdict.line)


def __getattr__(name: str) -> Any:
    """`flows.tools.tools`: the Prefect flow, built on first access (PEP 562)."""
    global _flow
    if name != "tools":
        raise AttributeError(name)
    if _flow is None:
        import tasks.hosts.lock  # noqa: F401  # sets the lease storage before any Prefect server starts
        from prefect import flow

        _flow = flow(name="tools", flow_run_name="tools")(run_tools)
    return _flow


def _selected(args: argparse.Namespace) -> tuple[Path, list[str]] | str:
    """The inventory and the lanes to run, or the one-line problem with them."""
    from tasks.inventory.models import ConfigError
    from tasks.inventory.load import check_prompt_files, load_inventory

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
    from flows.cli import _bad_input, run_flow

    selected = _selected(args)
    if isinstance(selected, str):
        return _bad_input(selected)
    hosts, names = selected
    artifacts = Path(args.artifacts).resolve()
    state, folder = run_flow("tools", lambda: __getattr__("tools"), artifacts, hosts=str(hosts.resolve()),
                             lanes=names, artifacts_root=str(artifacts), held_out=args.held_out)
    from tasks.record.progress import closing_verdict, say

    if folder:
        flow = json.loads((folder / "manifest.json").read_text())["flow"]
        for lane, entry in (flow.get("correctness") or {}).items():
            for gate in entry.get("gates", []):
                colour = "green" if gate["passed"] else "red"
                say(f"[bold]{lane}[/bold] [{colour}]{gate['gate']}[/{colour}]: {gate['detail']}")
    return closing_verdict(state, folder, "tools")


def register_cli(subparsers: Any) -> None:
    from tasks.engines.build import REPO

    p = subparsers.add_parser("tools", help="tool-call gate: boot each lane with a tool gate, smoke it, grade its suites")
    p.add_argument("--hosts", default=str(REPO / "hosts.yaml"), help="inventory file (default: the shipped hosts.yaml)")
    p.add_argument("--lane", action="append", help="run only this lane (repeatable; default: every lane with a tool gate)")
    p.add_argument("--held-out", action="store_true",
                   help="also run the held-out suite (each run is counted in the manifest)")
    p.add_argument("--artifacts", default=str(REPO / "artifacts"), help="folder that receives the run folder")
    p.set_defaults(func=cmd_tools)
