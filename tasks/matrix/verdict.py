"""The matrix verdict: each arm's measurements, and every registered bar judged against them.

Only arms that passed (gates held, tables passed their expectations) are measured; a failed or
skipped arm leaves its bars `no-data`, never a pass. Per arm and prompt class: acceptance length
and the per-position curve from the lane's acceptance table; draft efficiency = accepted / drafted
draft tokens from the probe's raw records (llama.cpp's `draft_n` / `draft_n_accepted`), where longer
drafts that only add rejected positions show first; single-stream tok/s, each probe request's output
over its end-to-end latency (one at a time), a repeat counting its median request. Per arm and
concurrency level: aggregate tok/s from the lane's decode curve. All medians over repeats, [min, max].
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path
from typing import Any, Literal

import pandas as pd
from pydantic import BaseModel

from tasks.record.run_folder import RunFolder
from tasks.matrix.config import Arm, Matrix, baseline_arm, judged_arms, prompt_class_of
from tasks.matrix.bars import Bar, Registration
from tasks.record.table_rows import ArmClassRow, VerdictRow
from tasks.wire.base import Record


_TOL = 1e-9


class SpeedRow(Record):
    arm: str
    concurrency: int
    aggregate_tok_s: float
    aggregate_tok_s_min: float
    aggregate_tok_s_max: float


def _stats(values: list[float]) -> tuple[float, float, float] | tuple[None, None, None]:
    return (statistics.median(values), min(values), max(values)) if values else (None, None, None)


def _entry_path(run: RunFolder, arm: str, kind: str) -> Path | None:
    return next((run.path / e.path for e in run.manifest.artifacts
                 if e.lane == arm and e.kind == kind and e.validation == "passed"), None)


def _per_request(run: RunFolder, m: Matrix, arm: str) -> dict[str, dict[str, tuple]]:
    """class -> {efficiency, tok_s, drafted}: per-repeat values from the probe's raw records."""
    if (path := _entry_path(run, arm, "requests")) is None:
        return {}
    classes = prompt_class_of(m)
    per: dict[tuple[str, int], dict[str, Any]] = {}
    for line in path.read_text().splitlines():
        r = json.loads(line)
        if r["stage"] != "acceptance" or not r["ok"] or (c := classes.get((r["prompt_class"], r["prompt_id"]))) is None:
            continue
        acc = per.setdefault((c, r["repeat"]), {"drafted": 0.0, "accepted": 0.0, "rates": []})
        spec = r.get("spec") or {}
        acc["drafted"] += float(spec.get("draft_n", 0.0))
        acc["accepted"] += float(spec.get("draft_n_accepted", 0.0))
        if r["e2el_s"] and r["output_tokens"]:
            acc["rates"].append(r["output_tokens"] / r["e2el_s"])
    out: dict[str, dict[str, tuple]] = {}
    for c in m.prompt_sets:
        reps = [v for (cc, _), v in sorted(per.items()) if cc == c]
        eff = [v["accepted"] / v["drafted"] for v in reps if v["drafted"] > 0]
        # A repeat's single-stream speed is its median request's: one stalled request must not stand for the class.
        tps = [statistics.median(v["rates"]) for v in reps if v["rates"]]
        out[c] = {"efficiency": _stats(eff), "tok_s": _stats(tps),
                  "drafted": (sum(v["drafted"] for v in reps),), "accepted_req": (sum(v["accepted"] for v in reps),)}
    return out


def collect(run: RunFolder, m: Matrix) -> tuple[list[ArmClassRow], list[SpeedRow], list[str]]:
    """Arm x class rows, arm x concurrency speed rows, and warnings (e.g. counters vs records disagree)."""
    rows, speed, warnings = [], [], []
    for arm in m.arms:
        record = run.manifest.lanes.get(arm.name)
        status, reason = (record.status, record.reason or "") if record else ("skipped", "")
        acc, reqs = pd.DataFrame(), {}
        if status == "passed":
            acc = pd.read_parquet(p) if (p := _entry_path(run, arm.name, "acceptance")) else acc
            for d in pd.read_parquet(p).itertuples() if (p := _entry_path(run, arm.name, "decode")) else []:
                speed.append(SpeedRow(arm=arm.name, concurrency=int(d.concurrency), aggregate_tok_s=d.aggregate_tok_s,
                                      aggregate_tok_s_min=d.aggregate_tok_s_min, aggregate_tok_s_max=d.aggregate_tok_s_max))
            reqs = _per_request(run, m, arm.name)
        for c in m.prompt_sets:
            row = ArmClassRow(arm=arm.name, drafter=arm.drafter, revision=arm.revision, k=arm.k, baseline=arm.baseline,
                              status=status, reason=reason, prompt_class=c, k_plus_1=arm.k + 1)
            hit = acc[acc.prompt_class == c] if not acc.empty else acc
            if not hit.empty:
                a = hit.iloc[0]
                curve = [float(x) for x in a.per_position]
                r = reqs.get(c, {})
                eff, tps = r.get("efficiency", (None,) * 3), r.get("tok_s", (None,) * 3)
                drafted = r.get("drafted", (None,))[0]
                counted = getattr(a, "draft_tokens", None)
                if eff[0] is None and counted is not None and not pd.isna(counted) and counted > 0:
                    # No per-request draft counts (vLLM): the probe window's counters, pooled over repeats.
                    drafted = float(counted)
                    eff = (float(a.accepted) / drafted,) * 3
                row = row.model_copy(update=dict(
                    repeats=int(a.repeats), acceptance_length=float(a.acceptance_length),
                    acceptance_length_min=float(a.acceptance_length_min), acceptance_length_max=float(a.acceptance_length_max),
                    per_position=curve, draft_shape=str(getattr(a, "draft_shape", None) or "chain"),
                    verify_steps=float(a.verify_steps), accepted=float(a.accepted), draft_tokens=drafted,
                    draft_efficiency=eff[0], draft_efficiency_min=eff[1], draft_efficiency_max=eff[2],
                    rejected_per_step=(drafted - float(a.accepted)) / float(a.verify_steps) if drafted else None,
                    single_stream_tok_s=tps[0], single_stream_tok_s_min=tps[1], single_stream_tok_s_max=tps[2],
                    curve_nonincreasing=all(y <= x + _TOL for x, y in zip(curve, curve[1:]))))
                from_records = r.get("accepted_req", (None,))[0]
                if from_records is not None and abs(from_records - float(a.accepted)) > 0.5:
                    warnings.append(f"{arm.name} {c}: accepted draft tokens from counters ({a.accepted:.0f}) and from "
                                    f"per-request records ({from_records:.0f}) differ")
            elif status == "passed":
                warnings.append(f"{arm.name}: no acceptance row for class {c}")
            rows.append(row)
    return rows, speed, warnings


def model_drift(run: RunFolder, m: Matrix) -> list[str]:
    """Arms compare only if they served the same bytes (preflight's sha256 of every file): one target
    sha256 across arms and now, one per drafter; a checkpoint rebuilt mid-matrix shows here."""
    from tasks.hosts.files import model_sha256

    seen: dict[str, dict[str, list[str]]] = {}  # label -> sha256 -> arms
    for arm in m.arms:
        record = run.manifest.lanes.get(arm.name)
        for f in (record.models if record else []):
            label = "target model" if f.role == "model" else f"drafter {arm.drafter}"
            seen.setdefault(label, {}).setdefault(str(f.sha256), []).append(arm.name)
    out = []
    for label, by_sha in seen.items():
        if len(by_sha) > 1:
            out.append(f"{label} bytes changed during the matrix: " + "; ".join(
                f"sha256 {sha[:12]} for {', '.join(arms)}" for sha, arms in by_sha.items()) + ": those arms are not comparable")
    target = Path(m.target.model.path)
    recorded = list(seen.get("target model", {}))
    if target.exists() and len(recorded) == 1 and model_sha256(target) != recorded[0]:
        out.append(f"target model {target.name} was rewritten after the last arm's preflight (sha256 now "
                   f"{model_sha256(target)[:12]}, served {recorded[0][:12]})")
    return out


def contention(run: RunFolder, m: Matrix) -> list[str]:
    """Speed compares across arms only under the same conditions: a 1-minute load well above the host's
    cores at an arm's end means other processes competed while it was timed (acceptance is unaffected)."""
    cores = run.manifest.host.cores or 1
    arms = run.manifest.flow.matrix.arms if run.manifest.flow.matrix else {}
    busy = {name: f.load_at_end for name, f in arms.items() if (f.load_at_end or 0) > 1.5 * cores}
    if not busy:
        return []
    return [f"speed rows and single-stream tok/s are not comparable across arms: other processes competed for the "
            f"CPU while {', '.join(f'{a} (1-min load {v:.1f})' for a, v in busy.items())} ran, on {cores} cores; "
            "acceptance numbers are unaffected"]


def _measure(bar: Bar, arm: Arm, rows: list[ArmClassRow], speed: list[SpeedRow]) -> tuple[float | None, float | None, float | None]:
    if bar.metric == "aggregate_tok_s":
        s = next((s for s in speed if s.arm == arm.name and s.concurrency == bar.concurrency), None)
        return (s.aggregate_tok_s, s.aggregate_tok_s_min, s.aggregate_tok_s_max) if s else (None, None, None)
    r = next((r for r in rows if r.arm == arm.name and r.prompt_class == bar.prompt_class), None)
    if r is None or r.acceptance_length is None:
        return None, None, None
    if bar.metric == "position_rate":
        assert r.per_position is not None and bar.position is not None
        v = r.per_position[bar.position - 1] if bar.position <= len(r.per_position) else None
        return v, v, v  # the curve is a median over repeats; its range is not kept per position
    return getattr(r, bar.metric), getattr(r, bar.metric + "_min"), getattr(r, bar.metric + "_max")


def judge(reg: Registration, m: Matrix, rows: list[ArmClassRow], speed: list[SpeedRow]) -> list[VerdictRow]:
    """Every registered bar on every arm it selects. Uses the registered copy, never the file."""
    out = []
    for i, (bar, words) in enumerate(zip(reg.parsed_bars(), reg.bars_text)):
        for arm in judged_arms(bar, m.arms):
            measured, lo, hi = _measure(bar, arm, rows, speed)
            base = baseline_arm(arm, m.arms) if bar.relative_to else None
            base_value, b_lo, b_hi = _measure(bar, base, rows, speed) if base else (None, None, None)
            notes = []
            outcome: Literal["pass", "fail", "no-data"]
            threshold = bar.margin if not bar.relative_to else base_value + bar.margin if base_value is not None else None
            if measured is None or threshold is None:
                missing = arm if measured is None or base is None else base
                record = next((r for r in rows if r.arm == missing.name), None)
                why = f"{record.status}: {record.reason}" if record and record.reason else (record.status if record else "")
                who = missing.name if missing is arm else f"baseline arm {missing.name}"
                notes.append(f"no measurement from {who}" + (f" ({why})" if why else ""))
                margin, outcome = None, "no-data"
            else:
                margin = measured - threshold if bar.op == ">=" else threshold - measured
                outcome = "pass" if margin >= 0 else "fail"
                if lo is not None and hi is not None and lo < threshold < hi:
                    notes.append("the bound lies inside the repeats' range: a close call")
                if lo is not None and hi is not None and b_lo is not None and b_hi is not None and not (hi < b_lo or lo > b_hi):
                    notes.append("arm and baseline ranges overlap")
            out.append(VerdictRow(
                bar_index=i, bar=words, bars_sha256=reg.bars_sha256, arm=arm.name, drafter=arm.drafter, k=arm.k,
                metric=bar.metric, prompt_class=bar.prompt_class, concurrency=bar.concurrency, op=bar.op,
                baseline_arm=base.name if base else None, baseline_value=base_value, threshold=threshold,
                measured=measured, measured_min=lo, measured_max=hi, margin=margin, outcome=outcome,
                note="; ".join(notes)))
    return out


class DrafterVerdict(BaseModel):
    drafter: str
    revision: str
    baseline: bool
    checks: int
    passed: int
    failed: int
    no_data: int
    failed_bars: list[str]

    @property
    def verdict(self) -> str:
        return "not judged" if not self.checks else "FAILED" if self.failed else "INCOMPLETE" if self.no_data else "PASSED"

    def sentence(self) -> str:
        who = f"Drafter **{self.drafter}** (revision {self.revision}{', the baseline' if self.baseline else ''})"
        if self.checks == 0:
            return f"{who} is not judged by any bar."
        if self.failed == self.checks:
            return f"{who} **failed every bar**: {self.failed} of {self.checks} checks failed."
        if self.checks > 2 and self.passed == 1 and self.failed == self.checks - 1:
            return f"{who} **failed every bar except one**: {self.failed} of {self.checks} checks failed."
        if self.failed:
            return (f"{who} **failed its bars**: {self.failed} of {self.checks} checks failed"
                    f"{f', {self.passed} passed' if self.passed else ''}"
                    f"{f', {self.no_data} not measured' if self.no_data else ''}.")
        if self.no_data:
            return f"{who} has **no verdict**: {self.no_data} of {self.checks} checks were not measured (see the arms table)."
        return f"{who} **passed every bar**: {self.checks} of {self.checks} checks."


def drafter_verdicts(m: Matrix, verdict: list[VerdictRow]) -> list[DrafterVerdict]:
    out = []
    for name, ref in m.spec.drafters.items():
        mine = [v for v in verdict if v.drafter == name]
        out.append(DrafterVerdict(
            drafter=name, revision=ref.revision, baseline=name == m.spec.baseline, checks=len(mine),
            passed=sum(v.outcome == "pass" for v in mine), failed=sum(v.outcome == "fail" for v in mine),
            no_data=sum(v.outcome == "no-data" for v in mine),
            failed_bars=[f"{v.arm}: {v.bar}" for v in mine if v.outcome == "fail"]))
    return out

