"""report.md: what ran, what passed, the tables, the regression verdicts and the plots, from
the run folder alone.

Only tables that passed their expectations appear as results; quarantined ones are listed
with the expectations they failed. Plots are PNG files beside the tables, linked relatively so
the folder reads the same wherever it is copied; `embed_images` inlines them for the Prefect
markdown artifact, which has no folder to link into.
"""

from __future__ import annotations

import base64
import re
from pathlib import Path
from typing import Any

import pandas as pd

from tasks.client.metrics import SERVER_AGREE_PCT
from tasks.record.markdown import frame
from tasks.correctness import record as correctness
from tasks.report import bench_report
from tasks.report.bench_report import num
from tasks.record.gpu_report import bandwidth_note, gpu_lines
from tasks.record.speculation import speculation_verdicts
from tasks.record.run_folder import RunFolder

MIN_P95_REQUESTS = 20  # a p95 over fewer requests is nearly their maximum: marked, never a headline
_DECODE_COLS = {
    "concurrency": "C", "aggregate_tok_s": "agg tok/s", "aggregate_spread_pct": "spread %",
    "per_user_tok_s": "per-user tok/s", "ttft_p50_s": "TTFT p50 s", "ttft_p95_s": "TTFT p95 s",
    "itl_p50_s": "ITL p50 ms", "requests": "requests", "failed_requests": "failed",
}


def _cell(v: Any) -> str:
    if isinstance(v, float):
        return f"{v:.3g}" if abs(v) < 1000 else f"{v:.0f}"
    return str(v)


def decode_table(df: pd.DataFrame) -> pd.DataFrame:
    out = df[list(_DECODE_COLS)].rename(columns=_DECODE_COLS).copy()
    out["ITL p50 ms"] = out["ITL p50 ms"] * 1000
    if "unstable" in df:  # host noise beside each level (tasks/hosts/noise.py)
        out["spread %"] = [f"{s:.3g} UNSTABLE" if u else f"{s:.3g}" for s, u in zip(df.aggregate_spread_pct, df.unstable)]
        out["load 1m / busy % / steal %"] = [
            "/".join(num(v, "{:.3g}") or "-" for v in (lo, b, st))
            for lo, b, st in zip(df.load_1m_before, df.busy_pct, df.steal_pct)]
        out["context-cut %"] = [f"{100 * v:.0f}" for v in df.context_truncated_share]
    # Enough to say anything: one repeat has no spread, a p95 under 20 requests is near their maximum.
    out["spread %"] = [f"n/a ({r} repeat)" if r < 2 else s for r, s in zip(df.repeats, out["spread %"])]
    out["TTFT p95 s"] = [f"{_cell(v)} (n={n}, TOO FEW)" if n < MIN_P95_REQUESTS else _cell(v)
                         for v, n in zip(df.ttft_p95_s, df.requests)]
    if "ttft_share_p50" in df:
        out["TTFT share"] = ["-" if v is None or pd.isna(v) else
                             f"{100 * v:.0f}% TTFT-DOMINATED" if v > 0.5 else f"{100 * v:.0f}%" for v in df.ttft_share_p50]
    out["agg tok/s"] = [f"{m:.1f} [{lo:.1f}, {hi:.1f}]" for m, lo, hi in
                        zip(df.aggregate_tok_s, df.aggregate_tok_s_min, df.aggregate_tok_s_max)]
    if "regime" in df:  # a level past the server's cap is a queue: labelled, never read as a speed
        out["regime"] = ["**queueing**" if r == "queueing" else "measured" for r in df.regime]
    # The load generator's columns where the table has them (docs/metrics.md).
    for column, label, scale in (("itl_p99_s", "ITL p99 ms", 1000), ("tpot_p50_s", "TPOT p50 ms", 1000),
                                 ("tokens_per_chunk", "tok/chunk", 1)):
        if column in df:
            out[label] = df[column] * scale
    if "client_saturated" in df:
        out["client-bound"] = ["yes" if v else "" for v in df.client_saturated]
    if "server_tok_s" in df and df.server_tok_s.notna().any():  # the engine's own timings, same window
        out["server tok/s (gap)"] = ["-" if pd.isna(s) else f"{s:.1f} ({g:+.1f} %){' DISAGREES' if abs(g) > SERVER_AGREE_PCT else ''}"
                                     for s, g in zip(df.server_tok_s, df.server_gap_pct)]
    if "bandwidth_share" in df and df.bandwidth_share.notna().any():  # beside the C=1 row (tasks/stages/limits.py)
        out["bandwidth share"] = [num(v, "{:.3g}") for v in df.bandwidth_share]
    return out


def acceptance_table(df: pd.DataFrame) -> pd.DataFrame:
    return pd.DataFrame({
        "class": df.prompt_class, "K": df.k, **_drafting(df),
        "acceptance length": [f"{m:.2f} [{lo:.2f}, {hi:.2f}]" for m, lo, hi in
                              zip(df.acceptance_length, df.acceptance_length_min, df.acceptance_length_max)],
        "per-position acceptance": [" · ".join(f"{p:.2f}" for p in pp) for pp in df.per_position],
        "verify steps": df.verify_steps.astype(int), "accepted": df.accepted.astype(int),
        **_acceptance_meaning(df),
    })


def _drafting(df: pd.DataFrame) -> dict:
    """Tree-shaped drafting said beside K: there per-position i is "accepted path at least i+1
    long", not chain position i (rows written before the column existed were chains)."""
    if "draft_shape" not in df or (df.draft_shape.fillna("chain") == "chain").all():
        return {}
    return {"drafting": [f"{s} (per-position: accepted path >= i+1)" if s.startswith("tree") else s
                         for s in df.draft_shape.fillna("chain")]}


def _acceptance_meaning(df: pd.DataFrame) -> dict:
    """Beside acceptance length per drafted step: tokens per target pass over every decode
    step, acceptance without budget-cut draft steps, the interval over prompts, truncated share."""
    if "tokens_per_pass" not in df or df.tokens_per_pass.isna().all():
        return {}
    def f(v: float | None, fmt: str = "{:.2f}") -> str:
        return num(v, fmt) or "-"

    return {
        "tokens / target pass": [f(v) for v in df.tokens_per_pass],
        "drafted steps %": [f(None if pd.isna(v) else 100 * v, "{:.0f}") for v in df.drafted_share],
        "AL without budget-cut steps": [f"{f(v)} ({int(c)} cut)" for v, c in
                                        zip(df.acceptance_length_full_steps, df.budget_cut_steps)],
        "95% interval over prompts": [f"[{f(lo)}, {f(hi)}] of {n}{'' if ok else ' (too few: no verdict)'}"
                                      for lo, hi, n, ok in zip(df.ci_low, df.ci_high, df.prompts, df.enough_prompts)],
        "context-truncated %": [f(100 * v, "{:.0f}") for v in df.truncated_share],
    }


def warmup_table(df: pd.DataFrame) -> pd.DataFrame:
    return pd.DataFrame({
        "C": df.concurrency, "size class": df.size_class,
        "first-hit e2el s": df.first_hit_e2el_s, "steady e2el s": df.steady_e2el_s,
        "first-hit cost s": [f"noise ({c:+.3g})" if n else f"{c:.3g}" for c, n in
                             zip(df.first_hit_cost_s, df.noise if "noise" in df else [False] * len(df))],
    })


_PLOT_TITLES = {"concurrency.png": "Decode curve", "acceptance.png": "Per-position acceptance",
                "trend.png": "Headline metrics over history (shaded: the noise band tonight was judged against)",
                "prefill.png": "Prefill ladder: cold prefill tok/s against prompt length, warm hit apart",
                "accuracy.png": "Accuracy with its interval: raw beside its truncated share, floor, right when finished",
                "capacity.png": "Capacity plan: users against context per user"}
_EMBED_LIMIT = 400_000  # bytes of PNG inlined into one Prefect artifact at most


def regression_table(df: pd.DataFrame) -> pd.DataFrame:
    def baseline(r: Any) -> str:
        if not r.baseline_runs:
            return "none"
        if pd.isna(r.baseline):
            return f"{num(r.baseline_min)}..{num(r.baseline_max)} ({int(r.baseline_runs)}, too few)"
        return f"{num(r.baseline)} ({int(r.baseline_runs)}, ±{r.baseline_spread_pct:.1f}%)"

    rows = list(df.itertuples())
    return pd.DataFrame({
        "metric": df.metric,
        "tonight": [num(v) for v in df.current],
        "baseline (runs, spread)": [baseline(r) for r in rows],
        "noise band": ["" if pd.isna(r.change_pct) else f"{num(r.band_low)}..{num(r.band_high)}" for r in rows],
        "change [interval]": ["" if pd.isna(r.change_pct) else
                              f"{r.change_pct:+.1f}% [{r.ci_low_pct:+.1f}%, {r.ci_high_pct:+.1f}%]" for r in rows],
        "min effect": [f"{v:g}%" for v in df.min_effect_pct],
        "verdict": [f"**{v}**" if v in ("regression", "suspect", "improvement") else v for v in df.verdict],
    })


def _regression_summary(run: RunFolder) -> list[str]:
    m = run.manifest
    policy = m.flow.regression_policy or {}
    entries = [a for a in m.artifacts if a.kind == "regression"]
    if not entries:
        return []
    out = ["", "## Against the baseline", ""]
    if policy:
        out += [f"Each headline metric against the last {policy.get('window')} earlier good runs of the same lane "
                f"(at least {policy.get('min_runs')}), with a {policy.get('confidence', 0.95):.0%} t interval on the "
                "change from the baseline runs' own spread (a zero-width interval: the baseline runs agreed "
                "exactly). A regression needs the whole interval on the worse side and at least the minimum "
                "effect; a speed metric needs it on two runs in a row (one alone is suspect); the noise band is "
                "where tonight's value would have been ordinary (docs/nightly.md).", ""]
    flagged = [f"- **COMPARISON REFUSED** {why}" for why in m.flow.comparison_refused.values()]
    for entry in entries:
        if entry.validation != "passed":
            out.append(f"- {entry.lane}: comparison QUARANTINED ({'; '.join(entry.failed_expectations)})")
            continue
        df = pd.read_parquet(run.path / entry.path)
        for r in df[df.verdict.isin(["regression", "suspect", "improvement"])].itertuples():
            flagged.append(f"- **{r.verdict}** {r.lane} `{r.metric}`: {r.change_pct:+.1f}% "
                           f"[{r.ci_low_pct:+.1f}%, {r.ci_high_pct:+.1f}%], {num(r.current)} against "
                           f"{num(r.baseline)} over {int(r.baseline_runs)} runs")
        judged = int((~df.verdict.isin(["no baseline", "too few samples", "not comparable"])).sum())
        if not judged and entry.lane not in m.flow.comparison_refused:
            out.append(f"- {entry.lane}: no baseline yet ({len(df)} metrics, fewer than "
                       f"{policy.get('min_runs', '?')} earlier good runs)")
    return out + (flagged or ["- no regression and no improvement beyond the noise"])


def embed_images(report: str, folder: Path) -> str:
    """The report with its relative PNG links inlined as data URIs (up to a total size)."""
    budget = [_EMBED_LIMIT]

    def inline(match: re.Match) -> str:
        path = folder / match.group(2)
        if not path.is_file() or path.stat().st_size > budget[0]:
            return f"*{match.group(1)}: `{match.group(2)}` in the run folder*"
        data = path.read_bytes()
        budget[0] -= len(data)
        return f"![{match.group(1)}](data:image/png;base64,{base64.b64encode(data).decode()})"

    return re.sub(r"!\[([^\]]*)\]\(([^)]+\.png)\)", inline, report)


def _verdict_line(run: RunFolder, judged: list[str]) -> str:
    """The morning's answer in one line: passed, or what failed and how many regressions."""
    m = run.manifest
    failed = [n for n, lane in m.lanes.items() if lane.status == "failed"]
    regressions = sum(int((pd.read_parquet(run.path / e.path).verdict == "regression").sum())
                      for e in m.artifacts if e.kind == "regression" and e.validation == "passed")
    parts = ([f"lanes failed: {', '.join(failed)}"] if failed else []) + \
        ([f"{regressions} regression{'s' if regressions > 1 else ''}"] if regressions else []) + \
        ([m.flow.regression_error] if m.flow.regression_error else []) + \
        [f"comparison refused for {lane}" for lane in m.flow.comparison_refused]
    if not parts:
        flagged = [f"{n}: {f.check}" for n, lane in m.lanes.items() for f in lane.flags]
        flagged += [f"{line.split(': ', 1)[1].split(' ')[0]}: {line.split(':')[0]}"
                    for line in judged if line.startswith(("SPECULATION LOSES", "NOT COMPARABLE"))]
        if flagged:
            return f"- verdict: **passed, FLAGGED** ({'; '.join(flagged)}): read the flags before trusting a number"
        return "- verdict: **passed**"
    return f"- verdict: **FAILED** ({'; '.join(parts)})"


def _preflight_lines(pre: dict, image: dict) -> list[str]:
    """What preflight found on the lane's links and hosts, and the image it ran (remote lanes)."""
    out = []
    for link in pre.get("links", []):
        bw = link.get("bandwidth")
        facts = [f"{end['host']} {end['interface']} {end.get('operstate')} mtu {end.get('mtu')}"
                 for end in (link["a"], link["b"]) if end]
        extra = f", {bw['gbps']:.3g} Gbit/s ({bw['tool']})" if bw else (f", {link['bandwidth_note']}" if link.get("bandwidth_note") else "")
        rtt = f", rtt {link['rtt_ms']:.2f} ms" if link.get("rtt_ms") is not None else ""
        verdict = "ok" if link["ok"] else f"**FAILED**: {link['reason']}"
        out.append(f"- link **{link['link']}** {verdict} ({'; '.join(facts)}{rtt}{extra})")
    for host in pre.get("hosts", []):
        disks = ", ".join(f"{d['role']} {d['avail_bytes'] / 2**30:.1f} GiB free" for d in host.get("disks", []))
        gpus = f", {len(host['gpus'])} GPU(s)" if host.get("gpus") else ""
        docker = f", docker {host['docker_server']}" if host.get("docker_server") else ""
        verdict = "ok" if host["ok"] else f"**FAILED**: {host['reason']}"
        out.append(f"- host **{host['host']}** {verdict}{docker}{gpus}{', ' + disks if disks else ''}")
    if image:
        how = "pulled" if image.get("pulled") else "already on the host"
        out.append(f"- image `{image['reference']}`: {how}, RepoDigests verified, image id `{image['image_id'][:19]}`")
    return out


def render(run: RunFolder) -> str:
    m = run.manifest
    judged = speculation_verdicts(run)  # may read history: once per report
    out = [f"# lanebench {m.flow.name} run `{run.path.name}`", "",
           f"- lanebench {m.lanebench.git_sha[:12]}{' (dirty tree)' if m.lanebench.dirty else ''}, "
           f"Prefect flow run `{m.flow.flow_run_id}`",
           f"- host {m.host.hostname}: {m.host.cpu}, {m.host.cores} cores, {m.host.memory_gib} GiB, "
           f"{m.host.platform}",
           f"- started {m.flow.started_at}, finished {m.flow.finished_at}", _verdict_line(run, judged), "",
           "## Lanes", "", "| lane | status | stage | reason |", "|---|---|---|---|"]
    out += [f"| {name} | **{lane.status}**{f' ({len(lane.flags)} flagged)' if lane.flags else ''} | {lane.stage} | "
            f"{lane.reason or ''} |" for name, lane in m.lanes.items()]
    out += _regression_summary(run)
    if judged:  # a speculative lane beside a plain one of the same target, or its last plain baseline
        out += ["", "## Speculation against no speculation", "",
                "Aggregate tok/s (decode curve median) of each speculative lane against the plain lane of the "
                "same target (same model sha256, nothing else different) at each concurrency both measured; "
                "with no such lane in this run, against its last plain baseline from history.", ""]
        out += [f"- **{line}**" if line.startswith(("SPECULATION LOSES", "NOT COMPARABLE")) else f"- {line}"
                for line in judged]
    builders = {"warmup": ("Warmup (first hit, never in results)", warmup_table),
                "decode": ("Decode curve", decode_table),
                "acceptance": ("Speculative acceptance (probe window only)", acceptance_table)}
    for name, lane in m.lanes.items():
        out += ["", f"## {name}", ""]
        out += _preflight_lines(lane.preflight, lane.image)
        if lane.launch_command:
            out += [f"- launch: `{lane.launch_command}`", f"- boot: {lane.boot_seconds:.1f} s; facts: "
                    + ", ".join(f"{k}={v}" for k, v in lane.boot_facts.items() if v not in (None, {}, "", []))]
        out += gpu_lines(lane.gpu, lane.boot_facts)
        out += [f"- gate **{gate.gate}** ({gate.kind}): {gate.detail}" for gate in lane.gates]
        out += [f"- waiver: implied gate **{w['gate']}** turned off: {w['reason']}" for w in lane.waivers]
        out += [f"- **{'FAILED' if f.severity == 'failure' else 'FLAG'}** {f.check}: {f.message}" for f in lane.flags]
        # Agentic smoke, thinking switch, tool gate, needle ladder (also in <lane>/correctness.md).
        out += correctness.section(run, name)
        out += [f"- warning: {warning}" for warning in lane.warnings]
        for entry in [a for a in m.artifacts if a.lane == name and a.kind in builders]:
            title, build = builders[entry.kind]
            if entry.validation == "failed":
                out += bench_report.quarantined(entry, title)
                continue
            df = pd.read_parquet(run.path / entry.path)
            out += ["", f"### {title}", "", frame(build(df), _cell)]
            if entry.kind == "decode":
                out += ["", f"Median of {int(df.repeats.iloc[0])} measured repeats per level, [min, max] in brackets; "
                        "spread = (max - min) / median."]
                if note := bandwidth_note(lane.bandwidth):
                    out += ["", note]
        # Capacity plan, prefill ladder, queueing levels, accuracy eval (tasks/report/bench_report.py).
        out += bench_report.section(run, name)
        for entry in [a for a in m.artifacts if a.lane == name and a.kind == "regression" and a.validation == "passed"]:
            out += ["", "### Against the baseline", "", frame(regression_table(pd.read_parquet(run.path / entry.path)), _cell)]
        for entry in [a for a in m.artifacts if a.lane == name and a.kind == "plot"]:
            out += ["", f"![{_PLOT_TITLES.get(Path(entry.path).name, Path(entry.path).stem)}]({entry.path})"]
        if v := next((a for a in m.artifacts if a.lane == name and a.kind == "requests"), None):
            out += ["", f"Raw per-request records: `{v.path}` ({v.rows} rows, expectations {v.validation})."]
            out += [f"- {f}" for f in v.failed_expectations]
    return "\n".join(out) + "\n"
