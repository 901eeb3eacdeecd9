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
names the run folder (flows/cli/tools.py checks the input first).
"""

from __future__ import annotations

from pathlib import Path

from prefect import flow
from prefect.runtime import flow_run
from prefect.states import Completed, Failed, State

from flows.lanes import LaneJob, run_lanes
from tasks.correctness import record as correctness
from tasks.inventory.load import load_inventory
from tasks.record.interrupted import interrupts, record_stop
from tasks.report.report import render
from tasks.record.run_folder import RunFolder
from tasks.record.verdict import STATE_NAMES, night_verdict


@flow(name="tools", flow_run_name="tools")
def tools(hosts: str, lanes: list[str], artifacts_root: str = "artifacts", held_out: bool = False) -> State:
    """Each named lane booted under its host lock, its tool gate run, the report written."""
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
