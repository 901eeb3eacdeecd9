"""The matrix report, publishable negative or not: each drafter's verdict in plain words first, then the
bars as registered (hash, changes since the last run), arms x bars with [min, max] over repeats, the
K trade as found or not, and plots (per-position acceptance per class, tok/s against K)."""

from __future__ import annotations

from pathlib import Path

from tasks.record.manifest import Manifest, MatrixSection
from tasks.record.markdown import table
from tasks.record.plots import _plt
from tasks.matrix.config import Matrix
from tasks.matrix.bars import EarlierRun, Registration
from tasks.matrix.verdict import ArmClassRow, DrafterVerdict, SpeedRow, VerdictRow

_STYLES = ["-", "--", ":", "-."]


def _f(v: float | None, digits: int = 2) -> str:
    return "—" if v is None else f"{v:.{digits}f}"


def _ranged(v: float | None, lo: float | None, hi: float | None, digits: int = 2) -> str:
    if v is None:
        return "—"
    if lo is None or hi is None or (abs(hi - lo) < 10 ** -(digits + 1)):
        return _f(v, digits)
    return f"{_f(v, digits)} [{_f(lo, digits)}, {_f(hi, digits)}]"


def _colors(drafters: list[str]) -> dict[str, str]:
    palette = ["tab:blue", "tab:orange", "tab:green", "tab:red", "tab:purple", "tab:brown", "tab:gray"]
    return {d: palette[i % len(palette)] for i, d in enumerate(drafters)}


def curves_png(m: Matrix, rows: list[ArmClassRow], path: Path) -> bool:
    """Per-position acceptance, one panel per prompt class, every arm overlaid (colour = drafter, line = K)."""
    measured = [r for r in rows if r.per_position]
    if not measured:
        return False
    plt = _plt()
    classes = list(m.prompt_sets)
    colors = _colors(list(m.spec.drafters))
    ks = sorted({a.k for a in m.arms})
    fig, axes = plt.subplots(1, len(classes), figsize=(4.6 * len(classes), 3.8), dpi=110, squeeze=False)
    for ax, c in zip(axes[0], classes):
        for r in [r for r in measured if r.prompt_class == c]:
            xs = list(range(1, len(r.per_position or []) + 1))
            tree = f", {r.draft_shape}: path >= i" if r.draft_shape.startswith("tree") else ""
            ax.plot(xs, r.per_position, _STYLES[ks.index(r.k) % len(_STYLES)], marker="o", markersize=3,
                    color=colors[r.drafter], label=f"{r.arm} (AL {r.acceptance_length:.2f}{tree})")
        ax.set(title=f"{c}: per-position acceptance", xlabel="draft position", ylim=(0, 1.02), xticks=range(1, max(ks) + 1))
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    axes[0][0].set_ylabel("rate (steps accepted to this position / steps)")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return True


def _by_k(points: list[tuple[int, float | None, float | None, float | None]]):
    """xs, ys and [down, up] error bars, by K; a missing bound draws no bar."""
    pts = sorted((k, v, v if low is None else low, v if high is None else high) for k, v, low, high in points if v is not None)
    return [p[0] for p in pts], [p[1] for p in pts], [[v - lo for _, v, lo, _ in pts], [hi - v for _, v, _, hi in pts]]


def k_png(m: Matrix, rows: list[ArmClassRow], speed: list[SpeedRow], path: Path) -> bool:
    """Against K, one line per drafter with [min, max] bars: acceptance length, draft efficiency
    and single-stream tok/s per class (top three rows), aggregate tok/s per speed level (last row)."""
    if not any(r.acceptance_length is not None for r in rows) and not speed:
        return False
    plt = _plt()
    classes, levels = list(m.prompt_sets), list(m.spec.speed.concurrency)
    cols = max(len(classes), len(levels))
    colors = _colors(list(m.spec.drafters))
    ks = sorted({a.k for a in m.arms})
    arm_of = {a.name: a for a in m.arms}
    metrics = [("acceptance_length", "acceptance length"), ("draft_efficiency", "draft efficiency (accepted/drafted)"),
               ("single_stream_tok_s", "single-stream tok/s")]
    panels: dict[tuple[int, int], tuple[str, str, dict[str, list]]] = {}  # (row, col) -> title, marker, points
    for row_i, (field, label) in enumerate(metrics):
        for col_i, c in enumerate(classes):
            panels[row_i, col_i] = (f"{c}: {label}", "o", {d: [
                (r.k, getattr(r, field), getattr(r, field + "_min"), getattr(r, field + "_max"))
                for r in rows if r.drafter == d and r.prompt_class == c] for d in m.spec.drafters})
    for col_i, level in enumerate(levels):
        panels[len(metrics), col_i] = (f"{m.speed_set} decode rows: aggregate tok/s at C={level}", "s", {d: [
            (arm_of[s.arm].k, s.aggregate_tok_s, s.aggregate_tok_s_min, s.aggregate_tok_s_max)
            for s in speed if s.arm in arm_of and arm_of[s.arm].drafter == d and s.concurrency == level]
            for d in m.spec.drafters})
    fig, axes = plt.subplots(len(metrics) + 1, cols, figsize=(4.4 * cols, 3.0 * (len(metrics) + 1)), dpi=100, squeeze=False)
    for row_i, row in enumerate(axes):
        for col_i, ax in enumerate(row):
            if (row_i, col_i) not in panels:
                ax.axis("off")
                continue
            title, marker, points = panels[row_i, col_i]
            for d, pts in points.items():
                xs, ys, err = _by_k(pts)
                if xs:
                    ax.errorbar(xs, ys, yerr=err, marker=marker, capsize=3, color=colors[d], label=d)
            ax.set_title(title, fontsize=9)
            ax.set(xlabel="K (draft width)", xticks=ks)
            ax.grid(alpha=0.3)
            ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return True


# An added draft position that keeps fewer tokens than this is dead weight: the seeds' prose
# tail kept 0.07, 0.05, 0.01 (positions 4-6) while code's stayed alive down to 0.13.
ALIVE = 0.1


def k_trade(m: Matrix, rows: list[ArmClassRow]) -> list[str]:
    """The seeds' finding, per drafter from its smallest to its largest K: on the easier class (higher
    acceptance length at the smallest K) acceptance length rises beyond the repeats' ranges with each
    added position keeping at least ALIVE tokens, while the harder class's keep less than half that."""
    out = []
    for d in m.spec.drafters:
        mine = [r for r in rows if r.drafter == d and r.acceptance_length is not None]
        ks = sorted({r.k for r in mine})
        classes = sorted({r.prompt_class for r in mine})
        if len(ks) < 2 or len(classes) < 2:
            out.append(f"- **{d}**: needs measured arms at two K on two classes to judge the trade; it has K {ks} "
                       f"on {classes}.")
            continue
        lo_k, hi_k = ks[0], ks[-1]
        at = {(r.k, r.prompt_class): r for r in mine}
        usable = [c for c in classes if (lo_k, c) in at and (hi_k, c) in at]
        if len(usable) < 2:
            out.append(f"- **{d}**: K={lo_k} and K={hi_k} were not both measured on two classes.")
            continue
        easy = max(usable, key=lambda c: at[(lo_k, c)].acceptance_length or 0.0)
        hard = min(usable, key=lambda c: at[(lo_k, c)].acceptance_length or 0.0)
        e0, e1, h0, h1 = at[(lo_k, easy)], at[(hi_k, easy)], at[(lo_k, hard)], at[(hi_k, hard)]
        added = hi_k - lo_k
        keep_easy = (e1.acceptance_length - e0.acceptance_length) / added  # type: ignore[operator]
        keep_hard = (h1.acceptance_length - h0.acceptance_length) / added  # type: ignore[operator]
        rises = e1.acceptance_length_min > e0.acceptance_length_max and keep_easy >= ALIVE  # type: ignore[operator]
        wastes = keep_hard < 0.5 * keep_easy
        facts = (f"K={lo_k} -> K={hi_k}: {easy} (the easier class) acceptance length {e0.acceptance_length:.2f} -> "
                 f"{e1.acceptance_length:.2f}, each added draft position keeps {keep_easy:.2f} tokens; {hard} "
                 f"{h0.acceptance_length:.2f} -> {h1.acceptance_length:.2f}, {keep_hard:.2f} per added position. "
                 f"Draft efficiency {easy} {_f(e0.draft_efficiency)} -> {_f(e1.draft_efficiency)}, {hard} "
                 f"{_f(h0.draft_efficiency)} -> {_f(h1.draft_efficiency)}; rejected draft tokens per verify step "
                 f"{easy} {_f(e0.rejected_per_step)} -> {_f(e1.rejected_per_step)}, {hard} {_f(h0.rejected_per_step)} "
                 f"-> {_f(h1.rejected_per_step)}.")
        if e0.single_stream_tok_s and e1.single_stream_tok_s and h0.single_stream_tok_s and h1.single_stream_tok_s:
            facts += (f" Single-stream tok/s {easy} {e0.single_stream_tok_s:.1f} -> {e1.single_stream_tok_s:.1f}, "
                      f"{hard} {h0.single_stream_tok_s:.1f} -> {h1.single_stream_tok_s:.1f}.")
        if rises and wastes:
            out.append(f"- **{d}** shows the trade: longer drafts pay on {easy} and are mostly thrown away on {hard}. "
                       + facts)
            continue
        missing = []
        if not rises:
            missing.append(f"acceptance length on {easy} does not rise enough with K (added positions keep "
                           f"{keep_easy:.2f} tokens each; alive means >= {ALIVE})")
        if not wastes:
            missing.append(f"{hard}'s added positions keep {keep_hard:.2f} tokens each, not less than half of "
                           f"{easy}'s {keep_easy:.2f}")
        direction = rises and keep_hard < keep_easy
        out.append(f"- **{d}** does NOT show the trade{' (only its direction)' if direction else ''}: "
                   f"{'; '.join(missing)}. {facts}")
    return out


def _arms(m: Matrix, manifest: Manifest, facts: MatrixSection) -> list[str]:
    """Each arm as it ran: status, port, boot and the load at its end."""
    out, arm_rows = ["", "## Arms", ""], []
    for a in m.arms:
        rec, arm_facts = manifest.lanes.get(a.name), facts.arms.get(a.name)
        boot = rec.boot_seconds if rec else None
        port, load = (arm_facts.port, arm_facts.load_at_end) if arm_facts else (None, None)
        arm_rows.append([a.name, a.drafter + (" (baseline)" if a.baseline else ""), a.revision, str(a.k),
                         f"**{rec.status if rec else 'not run'}**", "—" if port is None else str(port),
                         f"{boot:.1f}" if boot else "—", "—" if load is None else str(load),
                         (rec.reason if rec else "").replace("|", "/")])
    out += table(["arm", "drafter", "revision", "K", "status", "port", "boot s", "1-min load at end", "reason"],
                  arm_rows)
    if moved := [f"{name}: {f.port_note}" for name, f in facts.arms.items() if f.port_note]:
        out += ["", "Ports:"] + [f"- {line}" for line in moved]
    return out


def _verdict_grid(m: Matrix, reg: Registration, verdict: list[VerdictRow]) -> list[str]:
    out = ["", "## Verdict: arms x bars", "",
           "Each cell: outcome, measured median [min, max] over repeats. — : the bar does not judge that arm.", ""]
    grid = []
    for a in m.arms:
        judged = [next((v for v in verdict if v.arm == a.name and v.bar_index == i), None) for i in range(len(reg.bars_text))]
        grid.append([a.name, *("—" if v is None else "**no data**" if v.outcome == "no-data" else f"**{v.outcome}** "
                               f"{_ranged(v.measured, v.measured_min, v.measured_max, 1 if v.metric.endswith('tok_s') else 2)}"
                               for v in judged)])
    out += table(["arm"] + [f"bar {i + 1}" for i in range(len(reg.bars_text))], grid)
    out += ["", *table(["bar", "arm", "measured [min, max]", "bound", "baseline", "margin", "outcome", "note"], [
        [str(v.bar_index + 1), v.arm,
         _ranged(v.measured, v.measured_min, v.measured_max, 3),
         f"{v.op} {_f(v.threshold, 3)}", f"{v.baseline_arm} = {_f(v.baseline_value, 3)}" if v.baseline_arm else "",
         _f(v.margin, 3), f"**{v.outcome}**", v.note] for v in verdict])]
    return out


def _acceptance(m: Matrix, rows: list[ArmClassRow], speed: list[SpeedRow]) -> list[str]:
    out = ["", "## Acceptance, draft efficiency and speed per arm and class", "",
           "Acceptance length = 1 + accepted / verify steps (counter deltas over the probe window). Draft efficiency = "
           "accepted / drafted tokens: the share of verify work spent on tokens the target kept. Rejected/step = draft "
           "tokens the target verified and threw away per verify step. Single-stream tok/s: the probe's requests, one "
           "at a time, end to end. Median [min, max] over repeats.", ""]
    out += table(["arm", "class", "acceptance length", "per-position acceptance", "draft efficiency", "rejected/step",
                   "single-stream tok/s"],
                  [[r.arm, r.prompt_class,
                    _ranged(r.acceptance_length, r.acceptance_length_min, r.acceptance_length_max),
                    (" · ".join(f"{p:.2f}" for p in r.per_position) + (f" ({r.draft_shape}: accepted path >= i+1)"
                     if r.draft_shape.startswith("tree") else "")) if r.per_position else "—",
                    _ranged(r.draft_efficiency, r.draft_efficiency_min, r.draft_efficiency_max),
                    _f(r.rejected_per_step), _ranged(r.single_stream_tok_s, r.single_stream_tok_s_min,
                                                     r.single_stream_tok_s_max, 1)]
                   for r in rows if r.acceptance_length is not None] or [["—"] * 7])
    if speed:
        out += ["", f"Speed rows (`{m.speed_set}` prompts, the lane's decode curve, median [min, max] over repeats):", ""]
        out += table(["arm", "C", "aggregate tok/s"],
                      [[s.arm, str(s.concurrency), _ranged(s.aggregate_tok_s, s.aggregate_tok_s_min, s.aggregate_tok_s_max, 1)]
                       for s in speed])
    return out


def render(run_name: str, manifest: Manifest, m: Matrix, reg: Registration, earlier: EarlierRun | None,
           rows: list[ArmClassRow], speed: list[SpeedRow], verdict: list[VerdictRow], drafters: list[DrafterVerdict],
           plots: dict[str, str], warnings: list[str], quarantined: list[str], lanes_appendix: str) -> str:
    flow, host, git, lanes = manifest.flow, manifest.host, manifest.lanebench, manifest.lanes
    facts = flow.matrix
    assert facts is not None  # registered before the first arm booted
    out = [f"# Drafter matrix `{m.name}`: verdict", ""]
    judged = [d for d in drafters if not d.baseline] or drafters
    out += [f"- {d.sentence()}" for d in judged]
    out += [f"- {d.sentence()} (The baseline's own arms are judged by absolute bars only.)" for d in drafters
            if d.baseline and d is not judged[0] and d.checks]
    if quarantined:
        out += ["", f"**Not a trustworthy verdict**: these tables failed their expectations and were quarantined: "
                    f"{', '.join(quarantined)}."]
    drift = facts.verdict.model_drift if facts.verdict else []
    if drift:
        out += ["", "**Not a trustworthy comparison**: " + "; ".join(drift) + "."]
    failed_arms = [a.name for a in m.arms if a.name not in lanes or lanes[a.name].status != "passed"]
    if failed_arms:
        out += ["", f"**Incomplete matrix**: arm(s) {', '.join(failed_arms)} did not pass; their bars read no-data "
                    "(see Arms)."]
    out += ["", f"- run `{run_name}`, matrix file `{m.path}`, lanebench {git.git_sha[:12]}"
                f"{' (dirty tree)' if git.dirty else ''}, Prefect flow run `{flow.flow_run_id}`",
            f"- host {host.hostname}: {host.cpu}, {host.cores} cores, {host.memory_gib} GiB",
            f"- started {flow.started_at}, finished {flow.finished_at}",
            f"- target lane **{m.spec.target}** ({m.target.engine}, model `{Path(m.target.model.path).name}`) from "
            f"`{m.inventory_path}`; every arm booted fresh on it, one at a time",
            f"- {m.spec.repeats} repeats; acceptance probe: {m.spec.prompts_per_class} prompts per class, up to "
            f"{m.spec.max_tokens} tokens each, one request at a time; speed rows: `{m.speed_set}` prompts at "
            f"C={m.spec.speed.concurrency}, {m.spec.speed.max_tokens} tokens", ""]

    out += ["## Bars as registered", "",
            f"Registered at {reg.registered_at}, before any arm booted: sha256 `{reg.sha256}` "
            f"(bars `{reg.bars_sha256[:16]}`, prompt sets `{reg.prompt_sets_sha256[:16]}`). Baseline drafter: "
            f"**{reg.baseline}** (a relative bar compares an arm with the baseline's arm at the same K). "
            "The verdict below judges this registered copy, not the file as it is now.", ""]
    out += [f"{i + 1}. {t}" for i, t in enumerate(reg.bars_text)]
    out += ["", *table(["prompt set", "file", "sha256", "prompts used / in file"],
                        [[c, f"`{Path(f.path).name}`", f"`{f.sha256[:16]}`", f"{reg.prompts_per_class} / {f.prompts}"]
                         for c, f in reg.prompt_sets.items()]), ""]
    if earlier is None:
        out.append(f"First registered run of matrix `{m.name}` in this artifacts folder.")
    else:
        out += [f"**{line}**" if "CHANGED" in line else f"- {line}" for line in earlier.lines()]
    if changed := facts.file_changed_during_run:
        out += ["", f"**The matrix file changed while the run was going** ({changed}); the verdict uses the bars registered at the start."]

    out += _arms(m, manifest, facts) + _verdict_grid(m, reg, verdict) + _acceptance(m, rows, speed)
    out += ["", "## The K trade", "",
            "The seeds found that longer drafts raise acceptance length on the easier class and waste verify work on "
            "the harder one. Checked here per drafter from the smallest to the largest K:", ""]
    trade = k_trade(m, rows)
    out += trade
    if trade and not any(" shows the trade" in line for line in trade):
        out += ["", "**This matrix does not show the seeds' trade for any drafter** (the numbers above say why)."]
    if plots:
        out += ["", "## Plots", ""] + [f"![{title}]({rel})" for title, rel in plots.items()]
    if warnings:
        out += ["", "## Warnings", ""] + [f"- {w}" for w in warnings]
    if lanes_appendix:
        out += ["", "## Per-arm lane records", "",
                "Each arm's own lane record (launch command, boot facts, gates, warmup, decode and acceptance tables):", ""]
        body = lanes_appendix[lanes_appendix.find("## Lanes"):] if "## Lanes" in lanes_appendix else ""
        out += [("#" + line) if line.startswith("#") else line for line in body.splitlines()]
    return "\n".join(out) + "\n"
