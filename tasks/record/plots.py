"""PNG plots for report.md: the decode curve, per-position acceptance, prefill, accuracy, capacity,
and each headline metric's trend with the band the night was judged against.

Drawn from the same Parquet tables and history index as the tables, with matplotlib's Agg backend
(no display on a bench host); small figures at a low dpi, as a run folder is kept for months.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pandas as pd

from tasks.record.regression import RegressionRow

_DPI = 80
_VERDICT_COLOUR = {"regression": "tab:red", "suspect": "tab:purple", "improvement": "tab:green", "no change": "tab:blue",
                   "no baseline": "tab:gray",
                   "too few samples": "tab:gray", "not comparable": "tab:orange"}


def warm() -> None:
    """Import matplotlib and draw one small figure ahead of the first plot (the first text drawn
    loads the fonts: a third of a second that the report's first plot paid after the lane)."""
    plt = _plt()
    fig, ax = plt.subplots(figsize=(1, 1))
    ax.set_title("warm")
    fig.canvas.draw()
    plt.close(fig)


def _plt() -> Any:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _save(fig: Any, out: Path, tight: bool = True) -> Path:
    out.parent.mkdir(parents=True, exist_ok=True)
    if tight:
        fig.tight_layout()
    # No timestamp in the PNG metadata: the same figure gives the same bytes.
    fig.savefig(out, dpi=_DPI, metadata={"Software": None})
    _plt().close(fig)
    return out


def concurrency_curve(decode: pd.DataFrame, out: Path, title: str) -> Path:
    """Aggregate tok/s (median, min-max over repeats) and per-user tok/s against concurrency; TTFT beside."""
    plt = _plt()
    df = decode.sort_values("concurrency")
    fig, (ax, ax2) = plt.subplots(1, 2, figsize=(9, 3.4))
    err = [df.aggregate_tok_s - df.aggregate_tok_s_min, df.aggregate_tok_s_max - df.aggregate_tok_s]
    ax.errorbar(df.concurrency, df.aggregate_tok_s, yerr=err, marker="o", capsize=3, label="aggregate (min-max)")
    ax.plot(df.concurrency, df.per_user_tok_s, marker="s", linestyle="--", label="per user")
    ax.set(ylabel="tok/s", title=f"{title}: decode curve")
    ax2.plot(df.concurrency, df.ttft_p50_s, marker="o", label="TTFT p50")
    ax2.plot(df.concurrency, df.ttft_p95_s, marker="^", label="TTFT p95")
    ax2.set(ylabel="seconds", title="time to first token")
    for axis in (ax, ax2):
        axis.set(xscale="log", xlabel="concurrency")
        axis.set_xticks(list(df.concurrency), [str(c) for c in df.concurrency])
        axis.legend(fontsize=8)
    if "regime" in df and (df.regime == "queueing").any():  # past the cap: a queue, labelled on both panels
        queued = df[df.regime == "queueing"]
        for axis in (ax, ax2):
            axis.minorticks_off()
            axis.axvspan(queued.concurrency.min() / 1.2, queued.concurrency.max() * 1.2, color="tab:red", alpha=0.12)
            low, high = axis.get_ylim()
            for c in queued.concurrency:
                axis.annotate("queueing", (c, low + 0.9 * (high - low)), fontsize=7, color="tab:red", ha="center")
    return _save(fig, out)


def acceptance_positions(acceptance: pd.DataFrame, out: Path, title: str) -> Path:
    """Per-position acceptance per prompt class (rate at draft position k; never rises with k)."""
    plt = _plt()
    fig, ax = plt.subplots(figsize=(5.5, 3.4))
    for _, row in acceptance.sort_values("prompt_class").iterrows():
        curve = list(row.per_position)
        ax.plot(range(1, len(curve) + 1), curve, marker="o",
                label=f"{row.prompt_class} (length {row.acceptance_length:.2f})")
    ax.set(xlabel="draft position k", ylabel="acceptance rate", ylim=(0, 1.02),
           title=f"{title}: per-position acceptance")
    ax.legend(fontsize=8)
    return _save(fig, out)


def trend(history: dict[str, pd.DataFrame], rows: list[RegressionRow], current_run: str, out: Path,
          title: str) -> Path | None:
    """One panel per headline metric: its value over the lane's past runs, the baseline runs
    ringed, the noise band tonight was judged against shaded (the t band of the baseline window,
    centre dashed), tonight coloured by its verdict."""
    if not history:
        return None
    plt = _plt()
    verdicts = {r.metric: r for r in rows}
    metrics = sorted(history)
    ncols = min(4, len(metrics))
    nrows = math.ceil(len(metrics) / ncols)
    fig, axes = plt.subplots(nrows, ncols, figsize=(3.6 * ncols, 2.5 * nrows), squeeze=False)
    for ax, metric in zip(list(axes.flat)[: len(metrics)], metrics, strict=True):
        df = history[metric].reset_index(drop=True)
        x = list(range(len(df)))
        ax.plot(x, df.value, color="tab:blue", marker=".", linewidth=1)
        bad = df.regressed.fillna(False).astype(bool) & (df.run != current_run)
        ax.scatter([i for i in x if bad[i]], df.value[bad], color="tab:red", marker="x", zorder=3)
        row = verdicts.get(metric)
        base_runs = set((row.baseline_from or "").split(",")) if row else set()
        in_base = [i for i in x if df.run[i] in base_runs]
        ax.scatter(in_base, df.value[in_base], facecolor="none", edgecolor="tab:orange", s=45, zorder=3)
        if row is not None and row.band_low is not None and in_base:
            span = [min(in_base) - 0.3, len(df) - 0.7]
            ax.fill_between(span, row.band_low, row.band_high, color="tab:orange", alpha=0.2)
            ax.hlines(row.baseline, *span, color="tab:orange", linestyle="--", linewidth=1)
        cur = [i for i in x if df.run[i] == current_run]
        if cur and row is not None:
            ax.scatter(cur, df.value[cur], color=_VERDICT_COLOUR[row.verdict], s=60, zorder=4, edgecolor="black")
        sub: str = row.verdict if row is not None else ""
        if row is not None and row.change_pct is not None:
            sub += f" {row.change_pct:+.1f}%"
        ax.set_title(f"{metric}\n{sub}", fontsize=9)
        ticks = x[:: max(1, math.ceil(len(x) / 6))]
        ax.set_xticks(ticks, [pd.Timestamp(df.started_at[i]).strftime("%m-%d\n%H:%M") for i in ticks], fontsize=6)
        ax.tick_params(axis="y", labelsize=7)
        low, high = ax.get_ylim()  # a band of thousands of percent must not squash the runs flat
        values = df.value.dropna()
        if len(values) and row is not None and row.band_high is not None:
            pad = 0.25 * (values.max() - values.min() or abs(values.max()) or 1.0)
            ax.set_ylim(max(low, values.min() - pad), min(high, values.max() + pad))
    for ax in list(axes.flat)[len(metrics):]:
        ax.axis("off")
    fig.suptitle(f"{title}: headline metrics over history (ringed: baseline runs; shaded: noise band)", fontsize=10)
    # Fixed margins: tight_layout measured every tick label of every panel, a third of this
    # plot's second on the nightly's tail.
    fig.subplots_adjust(left=0.05, right=0.99, bottom=0.22 / nrows, top=1 - 0.28 / nrows, wspace=0.28,
                        hspace=0.8)
    return _save(fig, out, tight=False)


def prefill_ladder(prefill: pd.DataFrame, out: Path, title: str) -> Path | None:
    """Cold prefill tok/s against prompt tokens, the warm hit (the prefix cache's number) apart; TTFT beside."""
    df = prefill[prefill.status == "measured"].sort_values("prompt_tokens")
    if df.empty:
        return None
    plt = _plt()
    fig, (ax, ax2) = plt.subplots(1, 2, figsize=(9, 3.4))
    ax.plot(df.prompt_tokens, df.prefill_tok_s, marker="o", label="cold (nonce-led)")
    ax.plot(df.prompt_tokens, df.warm_tok_s, marker="s", linestyle="--", label="warm hit (cache)")
    ax.set(ylabel="prefill tok/s", title=f"{title}: prefill ladder")
    ax2.plot(df.prompt_tokens, df.cold_ttft_s, marker="o", label="cold TTFT")
    ax2.plot(df.prompt_tokens, df.warm_ttft_s, marker="s", linestyle="--", label="warm TTFT")
    ax2.set(ylabel="seconds", title="time to first token")
    for axis in (ax, ax2):
        axis.set(xscale="log", xlabel="prompt tokens")
        axis.legend(fontsize=8)
        axis.minorticks_off()
        axis.set_xticks(list(df.prompt_tokens), [f"{t:.0f}" for t in df.prompt_tokens])
    skipped = prefill[prefill.status == "skipped"]
    if not skipped.empty:
        fig.text(0.01, 0.01, "skipped (beyond the context per slot): " + ", ".join(str(r) for r in skipped.rung),
                 fontsize=7, color="tab:gray")
    return _save(fig, out)


_ACCURACY_LABELS = {"raw": "raw", "truncated_share": "cut off", "floor": "floor", "still_truncated_share": "still cut off",
                    "finished_right": "right when\nfinished"}


def accuracy_bars(accuracy: pd.DataFrame, out: Path, title: str) -> Path:
    """The five measures with their binomial intervals; the raw score never without its truncated share."""
    plt = _plt()
    df = accuracy.set_index("measure").reindex(list(_ACCURACY_LABELS)).reset_index()
    fig, ax = plt.subplots(figsize=(6.5, 3.2))
    values = df.value.fillna(0.0)
    colours = ["tab:blue", "tab:red", "tab:green", "tab:red", "tab:purple"]
    ax.bar(range(len(df)), values, color=colours, alpha=0.8)
    err = [(values - df.ci_low.fillna(values)).clip(lower=0), (df.ci_high.fillna(values) - values).clip(lower=0)]
    ax.errorbar(range(len(df)), values, yerr=err, fmt="none", ecolor="black", capsize=4)
    ax.set_xticks(range(len(df)), [f"{_ACCURACY_LABELS[m]}\n@{int(c)}" for m, c in zip(df.measure, df.max_tokens)],
                  fontsize=7)
    ax.set(ylim=(0, 1.05), ylabel="share of questions", title=f"{title}: accuracy (95% Wilson intervals)")
    return _save(fig, out)


def capacity_curve(capacity: pd.DataFrame, out: Path, title: str) -> Path:
    """Users against the context each can hold; the cap, the typical request and the decode levels marked."""
    plt = _plt()
    df = capacity.sort_values("users")
    fig, ax = plt.subplots(figsize=(5.5, 3.4))
    ax.step(df.users, df.context_per_user, where="post", marker="o", label="context per user")
    declared = df[df.declared]
    ax.scatter(declared.users, declared.context_per_user, s=60, facecolor="none", edgecolor="tab:orange", zorder=3,
               label="decode levels")
    typical = df.typical_tokens.dropna()
    if len(typical):
        ax.axhline(float(typical.iloc[0]), color="tab:red", linestyle="--", linewidth=1, label="typical request")
    cap = df.running_cap.dropna()
    if len(cap):
        ax.axvline(float(cap.iloc[0]), color="tab:gray", linestyle=":", label="running-request cap")
    ax.set(xscale="log", xlabel="users", ylabel="tokens per user", title=f"{title}: capacity plan")
    ax.minorticks_off()
    ax.set_xticks(list(df.users), [str(u) for u in df.users])
    ax.legend(fontsize=7)
    return _save(fig, out)
