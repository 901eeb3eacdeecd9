"""The correctness record of a lane: verdicts in the manifest, tables in `<lane>/correctness.md`.

The verdicts (agentic smoke, thinking switch, tool gate, needle ladder) live under
`flow.correctness.<lane>.gates`, apart from the declared boot gates; a failed one fails the lane.
"""

from __future__ import annotations

import pandas as pd

from tasks.record.markdown import table
from tasks.record.manifest import ArtifactEntry, CorrectnessEntry
from tasks.record.rows import GateResult
from tasks.record.run_folder import RunFolder
from tasks.correctness.tool_grader import MISS_KINDS, MISS_LABELS


def _money(v: float | None) -> str:
    return "" if v is None or pd.isna(v) else f"${v:.3f}"


def verdicts(run: RunFolder, lane: str) -> list[GateResult]:
    """The lane's correctness verdicts, in the order they were judged (append under `run.edit()`)."""
    return run.correctness(lane).gates


def section(run: RunFolder, lane: str) -> list[str]:
    """Markdown lines for one lane's correctness verdicts and tables (empty when it ran none)."""
    out: list[str] = []
    entries = {a.kind: a for a in run.manifest.artifacts if a.lane == lane and a.kind in ("tools", "needles")}
    entry_ledger = run.manifest.flow.correctness.get(lane) or CorrectnessEntry()
    for gate in entry_ledger.gates:
        out.append(f"- {gate.kind} **{gate.gate}** {'passed' if gate.passed else 'FAILED'}: {gate.detail}")
    if "tools" in entries:
        df = _heading(run, entries["tools"], "Tool-call gate", out)
        if df is not None:
            kinds = [k for k in MISS_KINDS if df[k].sum() > 0]
            header = ["suite", "split", "solved", "%", *(MISS_LABELS[k] for k in kinds), "seconds", "$ / 1,000 solved"]
            rows = [[r.suite, r.split + (f" #{r.run_number}" if r.split == "held_out" else ""),
                     f"{r.solved}/{r.cases}", f"{r.solved_pct:.1f}", *(str(getattr(r, k)) for k in kinds),
                     f"{r.seconds:.1f}", _money(r.cost_per_1000_solved)] for r in df.itertuples()]
            out += table(header, rows)
        protocol = entry_ledger.tool_gate.protocol if entry_ledger.tool_gate else {}
        if protocol:
            out += ["", f"Protocol `{protocol.get('path')}` (sha256 {str(protocol.get('sha256'))[:12]}): "
                        f"T={protocol.get('temperature')}, tool_choice {protocol.get('tool_choice')}, thinking "
                        f"{protocol.get('thinking')}, strict {'on' if protocol.get('strict') else 'off'}, no retries, "
                        f"concurrency {protocol.get('concurrency')}, max_tokens {protocol.get('max_tokens')}. "
                        "Scores compare candidates on this grader; they are not a leaderboard entry."]
        held = entry_ledger.tool_gate.held_out if entry_ledger.tool_gate else None
        if held and not held.run:
            out += [f"Held-out suite `{held.suite}` not run ({held.why})."]
    if "needles" in entries:
        df = _heading(run, entries["needles"], "Needle ladder", out)
        if df is not None:
            rows = [[r.needle_kind, str(r.rung), str(r.target_tokens), str(r.message_tokens),
                     "" if pd.isna(r.prompt_tokens) else str(int(r.prompt_tokens)),
                     f"{r.keys_found}/{r.keys_expected}", f"**{r.outcome}**" if r.outcome != "pass" else "pass"]
                    for r in df.itertuples()]
            out += table(["needle", "rung", "target tokens", "message tokens", "prompt tokens", "keys found",
                           "outcome"], rows)
            out += ["", "Each prompt opens with its own nonce; truncated = cut off by max_tokens before the keys "
                        "came back (counted apart from wrong answers)."]
    return out


def _heading(run: RunFolder, entry: ArtifactEntry, title: str, out: list[str]) -> pd.DataFrame | None:
    """The table's heading onto `out`; its rows, or None with its failed expectations listed (quarantined)."""
    quarantined = entry.validation == "failed"
    out += ["", f"### {title}" + (": QUARANTINED" if quarantined else ""), "",
            *(f"- {f}" for f in entry.failed_expectations if quarantined)]
    return None if quarantined else pd.read_parquet(run.path / entry.path)


def write(run: RunFolder, lane: str) -> None:
    """`<lane>/correctness.md`, registered in the manifest, when the lane ran any correctness table."""
    lines = section(run, lane)
    if not lines:
        return
    (run.lane_dir(lane) / "correctness.md").write_text(f"## {lane}: correctness\n" + "\n".join(lines) + "\n")
    run.register(lane, f"{lane}/correctness.md", "correctness-report")
