"""report.md sections for the prefill ladder, the accuracy eval, the capacity plan and the
queueing levels, from the run folder alone (tables that failed their suite are listed as
quarantined, never shown as results)."""

from __future__ import annotations

from collections.abc import Callable

import pandas as pd

from tasks.record.markdown import frame
from tasks.correctness.accuracy import AccuracyRow, in_words
from tasks.record.run_folder import ArtifactEntry, RunFolder

SEEDS_TRADE = ("The seeds' trade, for reading it: 640 state slots left a 201K-token pool, about 4K tokens per "
               "user at 48 users; 254 slots gave 56K tokens per user at 32.")


def num(v: object, fmt: str = "{:.4g}") -> str:
    return "" if v is None or (isinstance(v, float) and pd.isna(v)) else fmt.format(v)


def prefill_lines(df: pd.DataFrame) -> list[str]:
    table = pd.DataFrame({
        "rung": df.rung, "prompt tokens": [num(v, "{:.0f}") for v in df.prompt_tokens],
        "cold TTFT s": [num(v, "{:.4f}") for v in df.cold_ttft_s],
        "prefill tok/s (cold)": [num(v, "{:.0f}") for v in df.prefill_tok_s],
        "warm TTFT s": [num(v, "{:.4f}") for v in df.warm_ttft_s],
        "warm tok/s (cache)": [num(v, "{:.0f}") for v in df.warm_tok_s],
        "cache speedup": [num(v, "{:.2f}x") for v in df.cache_speedup],
        "status": [s if not r else f"{s}: {r}" for s, r in zip(df.status, df.reason)],
    })
    return [frame(table), "", "Each rung is one prompt that opens with a fresh nonce, so no prefix cache holds any of it: "
            "TTFT is the prefill. The warm hit sends the same prompt with the same nonce again and is reported "
            "apart: it shows the cache, and never counts as prefill speed."]


def accuracy_lines(df: pd.DataFrame) -> list[str]:
    rows = [AccuracyRow.model_validate({k: (None if isinstance(v, float) and pd.isna(v) else v)
                                        for k, v in r.items()}) for r in df.to_dict(orient="records")]
    names = {"raw": "raw score", "truncated_share": "cut off at max_tokens", "floor": "floor (re-asked, capped = wrong)",
             "still_truncated_share": "still cut off after the re-ask", "finished_right": "right when finished"}
    table = pd.DataFrame({
        "measure": [names[r.measure] for r in rows], "max_tokens": [r.max_tokens for r in rows],
        "count": [f"{r.count}/{r.of}" for r in rows],
        f"share [{rows[0].confidence:.0%} Wilson interval]": [
            "n/a" if r.value is None else f"{r.value:.1%} [{r.ci_low:.1%}, {r.ci_high:.1%}]" for r in rows],
    })
    return [f"**{in_words(rows)}.**", "", frame(table)]


def capacity_lines(df: pd.DataFrame, check: dict) -> list[str]:
    first = df.iloc[0]
    cap = "not stated" if pd.isna(first.running_cap) else f"{int(first.running_cap)}"
    head = (f"Pool: {int(first.pool_tokens)} KV tokens ({first.pool_shape}), running-request cap {cap}, typical "
            f"request {num(first.typical_tokens, '{:.0f}')} tokens (prompt + output).")
    table = pd.DataFrame({
        "users": df.users, "context per user": df.context_per_user,
        "within cap": ["yes" if v else "no: queued" for v in df.fits_cap],
        "typical request fits": ["yes" if v else "**no**" for v in df.typical_fits],
        "state slots (needed/have)": [f"{num(a, '{:.0f}')}/{num(b, '{:.0f}')}" if not pd.isna(a) else ""
                                      for a, b in zip(df.state_slots_needed, df.state_slots)],
        "KV bytes per seat": [num(v, "{:.3g}") or "not stated" for v in df.kv_bytes_per_seat],
        "decode level": ["yes" if v else "" for v in df.declared],
    })
    out = [head, ""]
    if check and not check.get("fits", True):
        out += [f"**Flagged before the curve ran: {check['warning']}.**", ""]
    elif check:
        out += [f"Declared concurrency {check['concurrency']} x typical {check['typical_tokens']} tokens = "
                f"{check['needed_tokens']} tokens fits the pool ({check['context_per_user']} tokens per user).", ""]
    return out + [frame(table), "", SEEDS_TRADE]


def queueing_lines(df: pd.DataFrame) -> list[str]:
    table = pd.DataFrame({
        "C": df.concurrency, "regime": df.regime, "cap": [num(v, "{:.0f}") for v in df.running_cap],
        "beyond cap": df.beyond_cap, "TTFT p50 s": [num(v, "{:.3f}") for v in df.ttft_p50_s],
        "queue wait p50 s": [num(v, "{:.3f}") for v in df.queue_wait_p50_s],
        "queue wait p95 s": [num(v, "{:.3f}") for v in df.queue_wait_p95_s],
        "served TTFT p50 s": [num(v, "{:.3f}") for v in df.served_ttft_p50_s],
        "queued (gauge peak / mean)": [f"{num(p, '{:.0f}')} / {num(m, '{:.1f}')} ({g})" if g else "no gauge"
                                       for p, m, g in zip(df.deferred_peak, df.deferred_mean, df.queue_gauge)],
    })
    return [frame(table), "", "Levels the lane declared `beyond_cap: queue`, run above the server's running-request "
            "cap: labelled **queueing** in the decode table and plot, and never part of a speed verdict (the "
            "regression check leaves them out). Queue wait = TTFT less the TTFT p50 at the highest level inside "
            "the cap."]


_SECTIONS: dict[str, tuple[str, Callable[..., list[str]]]] = {
    "capacity": ("Capacity plan: bytes per seat", capacity_lines),
    "prefill": ("Prefill ladder (cold, nonce-led; warm hit apart)", prefill_lines),
    "queueing": ("Queueing levels (past the cap: a queue, not a speed)", queueing_lines),
    "accuracy": ("Accuracy eval (truncation accounted for)", accuracy_lines),
}


def quarantined(entry: ArtifactEntry, title: str) -> list[str]:
    """A table that failed its suite: what it failed, never its numbers."""
    return ["", f"### {title}: QUARANTINED", "", "Failed expectations:", "", *(f"- {f}" for f in entry.failed_expectations)]


def section(run: RunFolder, lane: str) -> list[str]:
    """The four sections that have a table for `lane`, in recipe order."""
    out: list[str] = []
    entries: dict[str, ArtifactEntry] = {a.kind: a for a in run.manifest.artifacts if a.lane == lane}
    for kind, (title, build) in _SECTIONS.items():
        if (entry := entries.get(kind)) is None:
            continue
        if entry.validation == "failed":
            out += quarantined(entry, title)
            continue
        extra = [run.lane(lane).capacity] if kind == "capacity" else []
        out += ["", f"### {title}", "", *build(pd.read_parquet(run.path / entry.path), *extra)]
    return out
