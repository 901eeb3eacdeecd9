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
names the run folder (`lanebench tools` checks the input first).
"""

from __future__ import annotations

from pathlib import Path

from prefect import flow
from prefect.states import State

from flows.lane import TOOLS
from flows.lanes import LaneJob, run_lanes
from flows.lifecycle import NOTIFY, Closing, in_artifacts, lanes_verdict, open_run, run_lifecycle, write_report
from tasks.correctness import record as correctness
from tasks.inventory.load import load_inventory
from tasks.report.report import render
from tasks.record.run_folder import RunFolder


@flow(name="tools", flow_run_name="tools", **NOTIFY)
def tools(hosts: str, lanes: list[str], artifacts_root: str = "artifacts", held_out: bool = False) -> State:
    """Each named lane booted under its host lock, its tool gate run, the report written."""
    return in_artifacts("tools", artifacts_root, lambda root: _tools(hosts, lanes, root, held_out))


def _tools(hosts: str, lanes: list[str], artifacts_root: str, held_out: bool) -> State:
    inventory_path = Path(hosts).resolve()
    inventory = load_inventory(inventory_path)
    closing = Closing(report=_report, verdict=lambda run, _: lanes_verdict(run, "tools", []))
    run = open_run("tools", artifacts_root, inventory_path)
    run.manifest.flow.held_out_requested = held_out
    with run_lifecycle(run, "tools", lanes, closing) as life:
        run_lanes(run, [LaneJob.of(name, inventory, inventory_path, TOOLS.model_copy(update={"held_out": held_out})) for name in lanes])
    return life.state


def _report(run: RunFolder) -> None:
    """The lanes' report, each lane's correctness section after it."""
    report = render(run)
    for name in run.manifest.lanes:
        report += "\n" + "\n".join(correctness.section(run, name)) + "\n"
    write_report(run, report)
