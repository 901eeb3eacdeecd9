"""The numbers of the KL gate (the seeds' table "mean |Δlogp| vs FP8, median, p95, argmax ≠ FP8"):
- |Δlogprob| = |log p_lane(token) - log p_ref(token)| at the reference's greedy token, p_ref its first
  scoring; an argmax flip: the lane's most likely token is not that token. Stats pool every position.
- Between candidates a and b: |logprob_a - logprob_b|, the share of differing argmaxes, and the share
  where both flip *to the same wrong token*. Gap a-b = mean |Δ|_a - mean |Δ|_b on positions both
  scored, its 95% interval a seeded paired bootstrap over prompts (the independent units).
"""

from __future__ import annotations

from itertools import combinations
from math import nan

import numpy as np
import pandas as pd

from tasks.client.metrics import percentile
from tasks.kl.config import Bars
from tasks.wire.kl_probes import (ForcedScore, KlPairRow, KlPositionRow, KlRole, KlStatus, KlSummaryRow, KlVerdict,
                                   Sequence)


def position_rows(lane: str, sequences: list[Sequence], ref: dict[str, list[ForcedScore]],
                  scores: dict[str, list[ForcedScore]]) -> list[KlPositionRow]:
    """One row per position `lane` scored, beside the reference's first scoring of it."""
    rows = []
    for seq in sequences:
        ref_at = {s.position: s for s in ref.get(seq.prompt_id, [])}
        for s in scores.get(seq.prompt_id, []):
            r = ref_at[s.position]
            token = seq.continuation[s.position]
            rows.append(KlPositionRow(lane=lane, prompt_id=seq.prompt_id, position=s.position, token=token,
                                      ref_logprob=r.logprob, ref_argmax=r.argmax, logprob=s.logprob, argmax=s.argmax,
                                      abs_dlogprob=abs(s.logprob - r.logprob), flip=s.argmax != token))
    return rows


def describe(df: pd.DataFrame) -> dict[str, float | None]:
    """mean/median/p95/max of abs_dlogprob and the flip share; None when nothing was scored."""
    if df.empty:
        return dict.fromkeys(("mean_abs_dlogprob", "median_abs_dlogprob", "p95_abs_dlogprob", "max_abs_dlogprob",
                              "argmax_flip_share"))
    d = df["abs_dlogprob"].to_numpy(dtype=float)
    return {"mean_abs_dlogprob": float(d.mean()), "median_abs_dlogprob": float(np.median(d)),
            "p95_abs_dlogprob": percentile(d, 95), "max_abs_dlogprob": float(d.max()),
            "argmax_flip_share": float(df["flip"].mean())}


def bar_failures(stats: dict[str, float | None], bars: Bars) -> list[str]:
    """Each declared bar the numbers miss, as 'name value > bar'."""
    out = []
    for name, bar in bars.model_dump().items():  # max_<stat>
        value = stats.get(stat := name.removeprefix("max_"))
        if bar is not None and (value is None or value > bar):
            out.append(f"{stat} {value:.4g} > {bar:g}" if value is not None else f"{stat} not measured")
    return out


def summary_row(lane: str, role: KlRole, status: KlStatus, df: pd.DataFrame, expected: int, verdict: KlVerdict,
                reason: str = "") -> KlSummaryRow:
    return KlSummaryRow(lane=lane, role=role, status=status, prompts=int(df["prompt_id"].nunique()) if not df.empty else 0,
                        positions=len(df), positions_expected=expected, verdict=verdict, reason=reason, **describe(df))


def paired_bootstrap(a_sum: np.ndarray, b_sum: np.ndarray, n: np.ndarray, resamples: int,
                     seed: int) -> tuple[float, float, float]:
    """(gap, 2.5th, 97.5th percentile) of sum(a)/sum(n) - sum(b)/sum(n), prompts resampled together
    (scipy's paired percentile bootstrap: prompts are the independent units)."""
    from scipy.stats import bootstrap

    gap = float((a_sum.sum() - b_sum.sum()) / n.sum())
    if len(n) < 2:
        return gap, gap, gap
    result = bootstrap((a_sum, b_sum, n), lambda a, b, w, axis=-1: (a.sum(axis) - b.sum(axis)) / w.sum(axis),
                       paired=True, vectorized=True, n_resamples=resamples, method="percentile",
                       confidence_level=0.95, random_state=np.random.default_rng(seed))
    return gap, float(result.confidence_interval.low), float(result.confidence_interval.high)


def pair_row(a: str, b: str, da: pd.DataFrame, db: pd.DataFrame, resamples: int, seed: int) -> KlPairRow | None:
    """Candidates a and b on the positions both scored; None when they share none."""
    m = da.merge(db, on=["prompt_id", "position"], suffixes=("_a", "_b"))
    if m.empty or m["prompt_id"].nunique() < 2:
        return None
    between = (m["logprob_a"] - m["logprob_b"]).abs().to_numpy()
    per = m.groupby("prompt_id").agg(a=("abs_dlogprob_a", "sum"), b=("abs_dlogprob_b", "sum"), n=("position", "size"),
                                     fa=("flip_a", "sum"), fb=("flip_b", "sum"))
    n = per["n"].to_numpy(dtype=float)
    gap, low, high = paired_bootstrap(per["a"].to_numpy(float), per["b"].to_numpy(float), n, resamples, seed)
    fgap, flow, fhigh = paired_bootstrap(per["fa"].to_numpy(float), per["fb"].to_numpy(float), n, resamples, seed)
    both_same_wrong = m["flip_a"] & m["flip_b"] & (m["argmax_a"] == m["argmax_b"])
    return KlPairRow(
        lane_a=a, lane_b=b, prompts=len(per), positions=len(m),
        mean_abs_dlogprob=float(between.mean()), median_abs_dlogprob=float(np.median(between)),
        p95_abs_dlogprob=percentile(between, 95, nan),
        argmax_differs_share=float((m["argmax_a"] != m["argmax_b"]).mean()),
        same_wrong_flip_share=float(both_same_wrong.mean()),
        gap_mean_abs_dlogprob=gap, gap_ci_low=low, gap_ci_high=high, gap_ci_excludes_zero=bool(low > 0 or high < 0),
        gap_flip_share=fgap, gap_flip_ci_low=flow, gap_flip_ci_high=fhigh,
        a_closer_prompts=int((per["a"] / per["n"] < per["b"] / per["n"]).sum()), resamples=resamples, seed=seed)


def pair_rows(frames: dict[str, pd.DataFrame], resamples: int, seed: int) -> list[KlPairRow]:
    return [row for a, b in combinations(frames, 2) if (row := pair_row(a, b, frames[a], frames[b], resamples, seed)) is not None]
