"""The tool-call gate: a suite of tool requests on the booted server, graded, priced, under a pinned protocol.

A pinned protocol (toolsuites/protocol.yaml, copied into the manifest with its sha256), a dev suite
scored every time, a frozen held-out suite only when asked (each run counts the earlier runs of the
same bytes), misses by kind, the pass priced per 1,000 solved. `strict` stays off unless the
protocol says so: the seeds lost 35 of 600 with it on.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any, Literal

from prefect import task
from prefect.cache_policies import NO_CACHE
from pydantic import BaseModel

from tasks.record.manifest import SuiteRun, ToolGateLedger, scan_manifests
from tasks.record.run_folder import RunFolder
from tasks.serving.live import Endpoint
from tasks.client.chat import send_chats
from tasks.wire.replies import ChatReply
from tasks.inventory.models import Agentic, Host, Lane, ToolGatePlan, ToolProtocol, load_protocol
from tasks.inventory.load import shipped_or_local
from tasks.engines import Engine, engine_for
from tasks.hosts.files import sha256_of
from tasks.record.rows import GateResult
from tasks.correctness.thinking import switch_kwargs
from tasks.correctness.tool_grader import MISS_KINDS, MISS_LABELS, ToolCase, grade, load_suite, openai_tools
from tasks.record.table_rows import ToolGateRow


class ToolCaseRecord(BaseModel):
    """One graded case as it happened (raw, appended to `<lane>/tool_cases.jsonl`)."""

    lane: str
    suite: str
    split: Literal["dev", "held_out"]
    case_id: str
    category: str
    solved: bool
    kind: str | None
    detail: str
    finish_reason: str | None
    http_status: int | None
    calls: list[dict[str, str]]
    content: str
    seconds: float
    prompt_tokens: int | None
    completion_tokens: int | None
    started_at: float | None = None  # wall clock when it was sent (cases run concurrently)


def run_suite(base_url: str, engine: Engine, lane_name: str, cases: list[ToolCase], suite: str,
              split: Literal["dev", "held_out"], protocol: ToolProtocol, agentic: Agentic | None,
              ) -> tuple[list[ToolCaseRecord], dict[str, Any]]:
    """Send every case once under the protocol and grade it; returns the raw records and the tallies."""
    kwargs = switch_kwargs(agentic, protocol.thinking)
    specs = [engine.chat_request(case.messages, protocol.max_tokens, temperature=protocol.temperature,
                                 tools=openai_tools(case, protocol.strict), tool_choice=protocol.tool_choice,
                                 template_kwargs=kwargs) for case in cases]
    t0 = time.perf_counter()
    replies = send_chats(base_url, engine, specs, protocol.concurrency)
    seconds = time.perf_counter() - t0
    records = [_record(lane_name, suite, split, case, reply) for case, reply in zip(cases, replies)]
    tallies = {kind: sum(1 for r in records if r.kind == kind) for kind in MISS_KINDS}
    solved = sum(1 for r in records if r.solved)
    return records, {"cases": len(cases), "solved": solved, "seconds": seconds, **tallies}


def _record(lane: str, suite: str, split: Literal["dev", "held_out"], case: ToolCase,
            reply: ChatReply) -> ToolCaseRecord:
    verdict = grade(case, reply)
    return ToolCaseRecord(
        lane=lane, suite=suite, split=split, case_id=case.id, category=case.category, solved=verdict.solved,
        kind=verdict.kind, detail=verdict.detail, finish_reason=reply.finish_reason, http_status=reply.http_status,
        calls=[{"name": c.name, "arguments": c.arguments} for c in reply.tool_calls], content=reply.content[:500],
        seconds=reply.seconds, started_at=reply.started_at, prompt_tokens=reply.prompt_tokens,
        completion_tokens=reply.completion_tokens,
    )


REASK_FACTOR = 4


def reask_truncated(base_url: str, engine: Engine, lane_name: str, cases: list[ToolCase],
                    records: list[ToolCaseRecord], suite: str, split: Literal["dev", "held_out"],
                    protocol: ToolProtocol, lane: Lane) -> dict[str, Any]:
    """Ask the cases cut at max_tokens again at a higher cap (within the context), merged by case id."""
    cut = {r.case_id for r in records if r.kind == "truncated"}
    misses = sum(1 for r in records if not r.solved)
    out: dict[str, Any] = {"truncated_share": len(cut) / len(records) if records else 0.0,
                           "truncation_dominated": bool(cut) and len(cut) * 2 >= misses and len(cut) * 10 >= len(records)}
    if not cut:
        solved = sum(r.solved for r in records)
        pct = 100.0 * solved / len(records) if records else None
        return out | {"floor_pct": pct, "finished_and_right_pct": pct}
    cap = min(protocol.max_tokens * REASK_FACTOR, lane.context // 2)
    if cap <= protocol.max_tokens:
        return out
    again, _ = run_suite(base_url, engine, lane_name, [c for c in cases if c.id in cut], suite, split,
                         protocol.model_copy(update={"max_tokens": cap}), lane.agentic)
    merged = {r.case_id: r for r in records} | {r.case_id: r for r in again}
    finished = [r for r in merged.values() if r.kind != "truncated"]
    solved = sum(r.solved for r in merged.values())
    return out | {"reask_max_tokens": cap, "floor_pct": 100.0 * solved / len(merged),
                  "finished_and_right_pct": 100.0 * solved / len(finished) if finished else None}


def cost_per_1000_solved(seconds: float, solved: int, dollars_per_hour: float | None) -> float | None:
    """What 1,000 solved cases cost at this pass's speed: box time per solved case, times 1,000."""
    if dollars_per_hour is None or solved == 0:
        return None
    return dollars_per_hour * seconds / 3600.0 / solved * 1000.0


def summary(row: ToolGateRow) -> str:
    """One line: the score, the misses by kind, the time and the price."""
    misses = [f"{getattr(row, k)} {MISS_LABELS[k]}" for k in MISS_KINDS if getattr(row, k)]
    if row.cost_per_1000_solved is not None:
        price = f"${row.cost_per_1000_solved:.3f} per 1,000 solved at ${row.dollars_per_hour:g}/h"
    elif row.dollars_per_hour is None:
        price = "no cost (the host declares no dollars_per_hour)"
    else:
        price = "no cost per 1,000 solved (nothing solved)"
    run = f" (held-out run #{row.run_number})" if row.split == "held_out" else ""
    cut = ""
    if row.truncated:
        cut = (f"; {100 * row.truncated_share:.0f}% cut at max_tokens {row.max_tokens}"
               + (f", re-asked at {row.reask_max_tokens}: raw {row.solved_pct:.1f}%, floor {row.floor_pct:.1f}%, "
                  f"finished-and-right {_pct(row.finished_and_right_pct)}" if row.reask_max_tokens else "")
               + (" (FLAG: a score dominated by truncation measures the cap, not the model)"
                  if row.truncation_dominated else ""))
    return (f"{row.suite}{run}: {row.solved}/{row.cases} solved ({row.solved_pct:.1f}%); "
            f"misses: {', '.join(misses) or 'none'}; {row.seconds:.1f} s at concurrency {row.concurrency}; {price}{cut}")


def _pct(v: float | None) -> str:
    return "-" if v is None else f"{v:.1f}%"


def gate_result(plan: ToolGatePlan, row: ToolGateRow) -> GateResult:
    """The dev score gates the lane when `min_solved_pct` is declared; otherwise it is a report."""
    threshold = plan.min_solved_pct if row.split == "dev" else None
    passed = threshold is None or row.solved_pct >= threshold
    tail = "report only" if threshold is None else f"required >= {threshold:g}%: {'passed' if passed else 'failed'}"
    return GateResult(gate=f"tool-gate:{row.split}", kind="tools", passed=passed, value=row.solved_pct, op=">=",
                      threshold=threshold, detail=f"{summary(row)}; {tail}")


def earlier_held_out_runs(artifacts_root: Path, suite_sha256: str, this_run: str) -> list[str]:
    """`<run folder>:<lane>` of every earlier run of the same held-out suite bytes under the artifacts folder."""
    earlier = []
    for folder, m in scan_manifests(artifacts_root):
        if folder.name == this_run:
            continue
        for lane, entry in m.flow.correctness.items():
            held = entry.tool_gate.held_out if entry.tool_gate else None
            if held is not None and held.sha256 == suite_sha256 and held.run_number:
                earlier.append(f"{folder.name}:{lane}")
    return earlier


@task(name="tool-gate", cache_policy=NO_CACHE)
def tool_gate(endpoint: Endpoint, run_dir: str, lane: Lane, host: Host, base_dir: Path,
              held_out: bool = False) -> list[GateResult]:
    """Dev suite always, held-out suite when asked: raw records, the `tools` table, one gate result per suite."""
    plan = lane.correctness.tool_gate if lane.correctness else None
    if plan is None:
        return []
    run, lane_name = RunFolder.opened(run_dir), endpoint.lane
    engine = engine_for(lane.engine)
    protocol_path = shipped_or_local(base_dir, plan.protocol)
    protocol = load_protocol(protocol_path)
    ledger = ToolGateLedger(protocol={"path": plan.protocol, "sha256": sha256_of(protocol_path), **protocol.model_dump()})
    run.correctness(lane_name).tool_gate = ledger
    splits: list[tuple[Literal["dev", "held_out"], str]] = [("dev", plan.dev)]
    if plan.held_out is not None:
        if held_out:
            splits.append(("held_out", plan.held_out))
        else:
            ledger.held_out = SuiteRun(suite=plan.held_out, run=False, why="runs only when asked: lanebench tools --held-out")
    rows, results = [], []
    for split, rel in splits:
        path = shipped_or_local(base_dir, rel)
        cases, sha = load_suite(path), sha256_of(path)
        entry = SuiteRun(suite=rel, sha256=sha, cases=len(cases))
        run_number = 1
        if split == "held_out":
            earlier = earlier_held_out_runs(run.path.parent, sha, run.path.name)
            run_number = len(earlier) + 1
            entry = entry.model_copy(update={"run_number": run_number, "earlier_runs": earlier})
        with run.edit():
            setattr(ledger, split, entry)
        records, t = run_suite(endpoint.base_url, engine, lane_name, cases, Path(rel).name, split, protocol, lane.agentic)
        for record in records:
            run.append_jsonl(lane_name, "tool_cases.jsonl", record)
        truncation = reask_truncated(endpoint.base_url, engine, lane_name, cases, records, Path(rel).name, split,
                                     protocol, lane)
        row = ToolGateRow(
            lane=lane_name, suite=Path(rel).name, split=split, suite_sha256=sha,
            solved_pct=100.0 * t["solved"] / t["cases"], accounted=t["solved"] + sum(t[k] for k in MISS_KINDS),
            concurrency=protocol.concurrency, max_tokens=protocol.max_tokens, dollars_per_hour=host.dollars_per_hour,
            cost_per_1000_solved=cost_per_1000_solved(t["seconds"], t["solved"], host.dollars_per_hour),
            run_number=run_number, **t, **truncation,
        )
        with run.edit():
            entry.solved, entry.seconds = row.solved, round(row.seconds, 3)
        rows.append(row)
        results.append(gate_result(plan, row))
    run.register(lane_name, f"{lane_name}/tool_cases.jsonl", "tool-cases", rows=sum(r.cases for r in rows))
    run.write_table(lane_name, "tools", rows)
    return results
