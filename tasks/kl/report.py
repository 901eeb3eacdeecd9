"""report.md and the |Δlogprob| histogram of a KL run, written from its tables."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd

from tasks.record.plots import _plt

_HOW = """\
## How it was measured

The reference generated {tokens} greedy tokens per prompt (temperature 0{eos}); every lane
then scored exactly those token ids teacher-forced, with speculation off. |Δlogprob| is
|log p_lane(token) - log p_reference(token)| at each generated position, the reference's value
being its first scoring; an argmax flip is a position where the lane's most likely token is not
the reference's token. Mean, median and p95 pool all positions. Between candidates: |logprob_a -
logprob_b|, the share of positions where their argmaxes differ, and the share where both flip to
the same wrong token. The gap a-b is mean |Δ|_a - mean |Δ|_b on the positions both scored
(negative: a is closer); its 95% interval is a paired bootstrap over prompts ({resamples}
resamples, seed {seed}). The reference scored its own text twice: if the two scorings differed by
more than {tol:g} nats anywhere, the instrument would not be exact and no verdict would be given.
"""


def _f(v: object, digits: int = 4) -> str:
    if v is None or (isinstance(v, float) and np.isnan(v)):
        return "-"
    return f"{v:.{digits}f}" if isinstance(v, float) else str(v)


def _pct(v: float | None) -> str:
    return "-" if v is None or (isinstance(v, float) and np.isnan(v)) else f"{100 * float(v):.1f}%"


def histogram(positions: dict[str, pd.DataFrame], path: Path) -> bool:
    """|Δlogprob| per candidate on a log axis (below float32 resolution drawn at the left edge); False if nothing to draw."""
    data = {lane: df["abs_dlogprob"].to_numpy(float) for lane, df in positions.items() if not df.empty}
    if not data:
        return False
    plt = _plt()
    floor = 1e-7  # float32 log-probabilities resolve about this much near 0
    top = max(float(d.max()) for d in data.values())
    bins = np.logspace(np.log10(floor), np.log10(max(top, floor * 10)) + 0.05, 50)
    fig, ax = plt.subplots(figsize=(7, 4), dpi=110)
    for lane, d in data.items():
        ax.hist(np.clip(d, floor, None), bins=bins.tolist(), histtype="step", linewidth=1.6,
                label=f"{lane} (mean {d.mean():.3f}, n={len(d)})")
    ax.set(xscale="log", xlabel="|Δ logprob| vs reference (nats; values below 1e-7, exact ties included, drawn at 1e-7)",
           ylabel="positions", title="Teacher-forced |Δ logprob| per candidate")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return True


def render(title: str, facts: dict, summary: pd.DataFrame, pairs: pd.DataFrame, verdict: str,
           reasons: list[str], plot: str | None) -> str:
    intro = (f"Reference **{facts['reference']}**; candidates {', '.join(facts['candidates'])}. "
             f"{facts['prompts']} prompts x up to {facts['tokens_per_prompt']} tokens "
             f"({facts['positions']} positions), token text sha256 {facts['text_sha256'][:16]}. "
             f"Tokenizer probe: {facts['probe_tokens']} tokens on the reference; every scored lane tokenized it identically.")
    lines = [f"# KL gate: {title}", "", f"**{verdict}**" + (": " + "; ".join(reasons) if reasons else ""), "", intro, ""]
    ex = facts.get("exactness")
    if ex is not None:
        state = "exact" if ex["exact"] else "NOT exact: no verdict"
        line = (f"The reference scored its own text twice: max |Δlogprob| = {ex['max_abs_dlogprob']:.3g} nats, "
                f"{ex['differing_positions']} of {ex['positions']} positions differ (tolerance {ex['tolerance']:g}): **{state}**.")
        lines += ["## Exactness", "", line, ""]
    lines += ["## Lanes against the reference", "",
              "| lane | role | status | positions | mean \\|Δlogp\\| | median | p95 | max | argmax ≠ ref | verdict | reason |",
              "| --- | --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | --- | --- |"]
    for r in summary.to_dict(orient="records"):
        lines.append(f"| {r['lane']} | {r['role']} | {r['status']} | {r['positions']}/{r['positions_expected']} | "
                     f"{_f(r['mean_abs_dlogprob'])} | {_f(r['median_abs_dlogprob'])} | {_f(r['p95_abs_dlogprob'])} | "
                     f"{_f(r['max_abs_dlogprob'])} | {_pct(r['argmax_flip_share'])} | {r['verdict']} | {r['reason']} |")
    if not pairs.empty:
        head = ("| a vs b | positions | mean \\|Δlogp\\| | median | p95 | argmax differs | same wrong flip | "
                "gap a-b mean \\|Δ\\| (95% CI) | gap a-b flips (95% CI) | a closer on |")
        lines += ["", "## Candidates against each other", "", head,
                  "| --- | ---: | ---: | ---: | ---: | ---: | ---: | --- | --- | ---: |"]
        for r in pairs.to_dict(orient="records"):
            ci = f"{r['gap_mean_abs_dlogprob']:+.4f} [{r['gap_ci_low']:+.4f}, {r['gap_ci_high']:+.4f}]"
            ci += " (excludes 0)" if r["gap_ci_excludes_zero"] else " (includes 0)"
            fci = f"{100 * r['gap_flip_share']:+.1f} pp [{100 * r['gap_flip_ci_low']:+.1f}, {100 * r['gap_flip_ci_high']:+.1f}]"
            lines.append(f"| {r['lane_a']} vs {r['lane_b']} | {r['positions']} | {_f(r['mean_abs_dlogprob'])} | "
                         f"{_f(r['median_abs_dlogprob'])} | {_f(r['p95_abs_dlogprob'])} | {_pct(r['argmax_differs_share'])} | "
                         f"{_pct(r['same_wrong_flip_share'])} | {ci} | {fci} | {r['a_closer_prompts']}/{r['prompts']} prompts |")
    if plot:
        lines += ["", f"![|Δlogprob| histogram]({plot})"]
    bars = ", ".join(f"{k} {v:g}" for k, v in facts["bars"].items() if v is not None)
    lines += ["", f"Bars: {bars}.", "", _HOW.format(tokens=facts["tokens_per_prompt"],
                                                    eos=", EOS ignored" if facts["ignore_eos"] else "",
                                                    resamples=facts["resamples"], seed=facts["seed"],
                                                    tol=facts["tolerance"])]
    return "\n".join(lines)
