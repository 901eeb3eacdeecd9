"""Regression check: each headline metric of a lane against a baseline window of earlier good runs.

Baseline: the last `window` earlier runs of the same flow where the same lane passed and did not
regress (and were fingerprint-equal, started at or after `since`). The test is a t interval on
the change from the baseline runs' own spread, on the log scale where values are positive, held
for the lane as a whole (Bonferroni over its judged metrics); docs/nightly.md says why this test.
"""

from __future__ import annotations

import json
import math
from typing import Any

import numpy as np
import pandas as pd
from pydantic import BaseModel, Field

from tasks.record.kinds import metric_def
from tasks.record.rows import Finding
from tasks.record.table_rows import RegressionRow, Verdict


class RegressionPolicy(BaseModel):
    """How the nightly judges a change; a flow parameter, so a deployment can tune it."""

    window: int = Field(5, ge=2, le=100, description="baseline runs: the last N earlier good runs of the lane")
    min_runs: int = Field(2, ge=2, description="fewer baseline runs than this: no verdict (two give a spread)")
    confidence: float = Field(0.95, gt=0.5, lt=1.0)
    min_effect_pct: dict[str, float] = Field(
        default_factory=lambda: {"throughput": 5.0, "latency": 10.0, "acceptance": 3.0, "kl": 25.0},
        description="smallest change (percent) that can fail a night, per metric family")
    since: str | None = Field(None, description="ISO time or run folder name: ignore baseline runs before it")
    confirm_runs: dict[str, int] = Field(
        default_factory=lambda: {"throughput": 2, "latency": 2},
        description="runs in a row a metric of this family must read as a regression before it fails a night "
                    "(1 for the families not listed): speed moves with whatever else shares the host, so one "
                    "slow night alone is 'suspect', kept out of the baselines and confirmed or cleared by the next")


class LaneComparison(BaseModel):
    lane: str
    rows: list[RegressionRow]
    config_changes: list[str] = []  # this run's lane config against the newest baseline run's
    # Why the comparison is refused (too few fingerprint-equal runs): the fields that differ.
    refused: str = ""

    @property
    def regressions(self) -> list[RegressionRow]:
        return [r for r in self.rows if r.verdict == "regression"]

    @property
    def suspects(self) -> list[RegressionRow]:
        return [r for r in self.rows if r.verdict == "suspect"]

    def suspect_flags(self) -> list[Finding]:
        """One lane flag per suspect metric: the night passes, and says why it is not yet a regression."""
        return [Finding(check="suspect", declared=f"{r.metric} in [{r.band_low:.4g}, {r.band_high:.4g}]",
                        effective=f"{r.current:.4g}", severity="flag",
                        message=f"{describe(r)}: suspect, not yet a regression: speed moves with whatever else "
                                "shares the host, so one run alone does not fail the night; the next run confirms "
                                "or clears it; fix: re-run on a quiet host") for r in self.suspects]


def t_quantile(p: float, df: int) -> float:
    """The p-quantile of Student's t with `df` degrees of freedom."""
    from scipy.stats import t as student_t

    return float(student_t.ppf(p, df))


# --- the test -------------------------------------------------------------------------------

class Judged(BaseModel):
    centre: float
    spread_pct: float
    change_pct: float
    low_pct: float
    high_pct: float
    band_low: float
    band_high: float


def change_interval(current: float, baseline: list[float], confidence: float) -> Judged | None:
    """The change of `current` against `baseline` runs with its interval; None when a percent is undefined."""
    values = np.asarray(baseline, dtype=float)
    n = len(values)
    q = t_quantile(0.5 + confidence / 2.0, n - 1) * math.sqrt(1.0 + 1.0 / n)
    if current > 0 and (values > 0).all():
        logs = np.log(values)
        m, s = float(logs.mean()), float(logs.std(ddof=1))
        d = math.log(current) - m
        pct = lambda v: math.expm1(v) * 100.0  # noqa: E731
        centre = min(max(math.exp(m), float(values.min())), float(values.max()))  # exp(log) may round outside
        return Judged(centre=centre, spread_pct=pct(s), change_pct=pct(d), low_pct=pct(d - q * s),
                      high_pct=pct(d + q * s), band_low=math.exp(m - q * s), band_high=math.exp(m + q * s))
    m, s = float(values.mean()), float(values.std(ddof=1))
    if m == 0:
        return None
    scale = 100.0 / abs(m)
    d = current - m
    return Judged(centre=m, spread_pct=s * scale, change_pct=d * scale, low_pct=(d - q * s) * scale,
                  high_pct=(d + q * s) * scale, band_low=m - q * s, band_high=m + q * s)


def verdict(better: str, change: float, lo: float, hi: float, min_effect: float) -> Verdict:
    worse_sure = hi < 0 if better == "higher" else lo > 0
    better_sure = lo > 0 if better == "higher" else hi < 0
    big = abs(change) >= min_effect
    if worse_sure and big and (change < 0) == (better == "higher"):
        return "regression"
    if better_sure and big and (change > 0) == (better == "higher"):
        return "improvement"
    return "no change"


_NOT_MEASURED = {"port", "boot_timeout_s"}  # config fields that cannot move a number


def config_changes(current: str, previous: str) -> list[str]:
    """Lane config fields that differ (`threads: 2 -> 1`): a regression with a cause written next to it."""
    from tasks.record.fingerprint import differences, flat

    diffs = differences(flat(json.loads(current or "{}")), flat(json.loads(previous or "{}")))
    return [f"{k}: {a} -> {b}" for k, a, b in diffs if k not in _NOT_MEASURED]


def _fingerprint_of(con: Any, run: str, lane: str, cache: dict[str, dict[str, str]]) -> dict[str, str]:
    """The lane's fingerprint in `run` (computed from its record for runs made before fingerprints)."""
    if run not in cache:
        from pathlib import Path

        from tasks.record.fingerprint import fingerprint
        from tasks.record.manifest import HostFacts, LaneRecord, ManifestError, read_manifest

        (path,), = con.execute("SELECT path FROM runs WHERE run = ?", [run]).fetchall()
        try:
            m = read_manifest(Path(path))
        except (OSError, ManifestError):
            m = None
        record = (m.lanes.get(lane) if m else None) or LaneRecord()
        base = Path(m.inventory.path).parent if m and m.inventory else None
        cache[run] = record.fingerprint or fingerprint(record, m.host if m else HostFacts(), base)
    return cache[run]


def _suspect_streaks(con: Any, flow: str, lane: str, started: Any) -> dict[str, int]:
    """Per metric, how many of the lane's latest judged runs before this one, in a row, read it as
    "suspect" or "regression" (a CI run caught a ~28 % slowdown on one night while another job shared
    the 2-core box; the next night read it as noise)."""
    rows = con.execute(
        """SELECT g.metric, g.verdict FROM regression g JOIN runs r ON r.run = g.run
           WHERE r.flow = ? AND g.lane = ? AND r.started_at < ? ORDER BY r.started_at DESC""",
        [flow, lane, started]).fetchall()
    streaks: dict[str, int] = {}
    ended: set[str] = set()
    for metric, v in rows:
        if metric in ended:
            continue
        if v in ("suspect", "regression"):
            streaks[metric] = streaks.get(metric, 0) + 1
        else:
            ended.add(metric)
    return streaks


def compare_lane(con: Any, run: str, lane: str, policy: RegressionPolicy) -> LaneComparison:
    """Every headline metric of `lane` in `run` against its baseline window of fingerprint-equal runs
    (a replaced model file or upgraded engine is not noise); with too few of those but enough
    earlier good runs, the comparison is refused naming the fields that differ."""
    (flow, started, config), = con.execute(
        """SELECT r.flow, r.started_at, l.config FROM runs r LEFT JOIN lanes l ON l.run = r.run AND l.lane = ?
           WHERE r.run = ?""", [lane, run]).fetchall()
    since = None
    if policy.since:
        row = con.execute("SELECT started_at FROM runs WHERE run = ?", [policy.since]).fetchone()
        since = row[0] if row else pd.Timestamp(policy.since, tz="UTC")
    current = con.execute(
        "SELECT metric, value, samples FROM metrics WHERE run = ? AND lane = ? AND headline ORDER BY metric",
        [run, lane]).fetchall()
    newest_baseline: str | None = None
    bases: dict[str, list[tuple[str, float]]] = {}
    prints: dict[str, dict[str, str]] = {}
    tonight = _fingerprint_of(con, run, lane, prints)
    refused_against: str | None = None
    for metric, _value, _samples in current:
        d = metric_def(metric)
        assert d is not None
        earlier = con.execute(
            """SELECT run, value FROM metrics
               WHERE flow = ? AND lane = ? AND metric = ? AND passed AND NOT regressed AND NOT suspect AND run <> ?
                 AND started_at < ? AND (? IS NULL OR started_at >= ?) AND value IS NOT NULL AND NOT isnan(value)
                 AND (samples IS NULL OR samples >= ?)
               ORDER BY started_at DESC LIMIT ?""",
            [flow, lane, metric, run, started, since, since, d.min_samples, 10 * policy.window]).fetchall()[::-1]
        bases[metric] = [b for b in earlier if _fingerprint_of(con, b[0], lane, prints) == tonight][-policy.window:]
        if len(bases[metric]) < policy.min_runs and len(earlier) >= policy.min_runs:
            refused_against = refused_against or earlier[-1][0]
    enough = {m for m, v, n in current if (n is None or n >= metric_def(m).min_samples)  # type: ignore[union-attr]
              and v is not None and not math.isnan(v)}
    judged_count = sum(1 for m in enough if len(bases[m]) >= policy.min_runs)
    confidence = 1 - (1 - policy.confidence) / max(judged_count, 1)  # for the lane as a whole (docstring)
    rows = []
    suspects = _suspect_streaks(con, flow, lane, started)
    for metric, value, _samples in current:
        d = metric_def(metric)
        assert d is not None
        base = bases[metric]
        newest_baseline = newest_baseline or (base[-1][0] if base else None)
        values = [float(v) for _, v in base]
        j = change_interval(float(value), values, confidence) if metric in enough and len(base) >= policy.min_runs else None
        min_effect = policy.min_effect_pct.get(d.family, 5.0)
        common = dict(lane=lane, metric=metric, family=d.family, better=d.better, current=float(value),
                      min_effect_pct=min_effect, baseline_runs=len(base), baseline_from=",".join(b[0] for b in base),
                      baseline_min=min(values) if values else None, baseline_max=max(values) if values else None)
        if j is None:
            not_comparable = refused_against is not None and len(base) < policy.min_runs
            rows.append(RegressionRow(**common, verdict="too few samples" if metric not in enough else
                                      "not comparable" if not_comparable else "no baseline"))
        else:
            v = verdict(d.better, j.change_pct, j.low_pct, j.high_pct, min_effect)
            if v == "regression" and suspects.get(metric, 0) + 1 < policy.confirm_runs.get(d.family, 1):
                v = "suspect"
            rows.append(RegressionRow(**common, baseline=j.centre, baseline_spread_pct=j.spread_pct, band_low=j.band_low,
                                      band_high=j.band_high, change_pct=j.change_pct, ci_low_pct=j.low_pct,
                                      ci_high_pct=j.high_pct, verdict=v))
    prev = con.execute("SELECT config FROM lanes WHERE run = ? AND lane = ?",
                       [newest_baseline or refused_against, lane]).fetchone()  # refused: what changed, too
    changes = config_changes(config, prev[0]) if prev and config else []
    refused = ""
    if refused_against is not None:
        from tasks.record.fingerprint import describe_differences, differences

        diffs = differences(tonight, _fingerprint_of(con, refused_against, lane, prints))
        refused = (f"{lane}: not comparable with the baseline window (newest earlier good run {refused_against}): "
                   f"{describe_differences(diffs)}; fewer than {policy.min_runs} earlier runs hold everything "
                   "else equal; fix: undo the change, or accept it as the new baseline with the regression "
                   f"policy's since: {run}")
    return LaneComparison(lane=lane, rows=rows, config_changes=changes, refused=refused)


def describe(row: RegressionRow) -> str:
    """`rehearsal tok_s@c1 -31.2% [-38.0%, -24.9%] (12.1 vs 17.6 over 3 runs)`."""
    if row.change_pct is None:
        return f"{row.lane} {row.metric}: no baseline ({row.baseline_runs} earlier good runs)"
    return (f"{row.lane} {row.metric} {row.change_pct:+.1f}% [{row.ci_low_pct:+.1f}%, {row.ci_high_pct:+.1f}%] "
            f"({row.current:.4g} vs {row.baseline:.4g} over {row.baseline_runs} runs)")


__all__ = ["LaneComparison", "RegressionPolicy", "RegressionRow", "compare_lane", "describe"]
