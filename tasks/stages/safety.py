"""Safe by default: the gates a lane implies, and declared against effective values.

A drafter that never drafted, a bench above a 7-slot cap, a K overridden by a flag, a drafter that
was the target: each passed because its gate had to be declared by hand. Here a drafter implies
a counter gate (and draft width, and no synthetic acceptance), every bench the capacity gate;
turning one off takes a recorded waiver. Each declared/effective difference names both and the fix.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from tasks.wire.records import RequestRecord
from tasks.engines import Engine, engine_for
from tasks.engines.build import BuildError
from tasks.engines.facts import BootFacts, Metrics
from tasks.inventory.models import CapacityGate, CounterGate, Gate, Lane
from tasks.record.manifest import ModelFacts
from tasks.record.rows import Finding, GateResult

# Acceptance this close to K+1 means the drafter almost never disagrees with the target: in
# the seeds that was the target serving as its own drafter (4.70 at K=4), reported as a triumph.
# The shipped good drafter reads 3.93 at K=4 on code (0.79 of the ceiling).
NEAR_PERFECT = 0.9
# Fewer decode steps than this carried a draft: acceptance length (per drafted step) no longer
# says what users get (the seeds' draft floor lifted 2.09 to 2.67 while the target made ~1.15
# tokens per pass). The last step of each request cannot draft (no budget left), hence not 1.0.
MIN_DRAFTED_SHARE = 0.8
WARMUP_JITTER = 0.25  # a first hit faster than steady by more than this share of steady is flagged
WARMUP_JITTER_S = 0.02  # ... and by more than this: a few ms either way is a 2-core scheduler, not a finding
TTFT_DOMINATES = 0.5  # a decode row whose median TTFT is over this share of e2el measures prefill
MIN_PROMPTS = 8  # = tasks/stages/acceptance.py MIN_PROMPTS_FOR_VERDICT


def waived(lane: Lane, gate: str) -> bool:
    return any(w.gate == gate for w in lane.waivers)


def implied_gates(lane: Lane, engine: Engine) -> list[Gate]:
    """The lane's declared gates plus the ones it implies, unless waived or covered by a declared gate at least
    as strict (a weaker one, `>= 0`, keeps the implied one)."""
    gates: list[Gate] = list(lane.gates)
    covered = any(isinstance(g, CounterGate) and g.metric == engine.draft_counter and g.implies(">", 0)
                  for g in gates)
    if (lane.drafter is not None and engine.draft_counter is not None and not covered
            and not waived(lane, "counter")):
        gates.append(CounterGate(kind="counter", name="drafts-happen (implied)", metric=engine.draft_counter,
                                 op=">", threshold=0))
    if not any(isinstance(g, CapacityGate) for g in gates) and not waived(lane, "capacity"):
        gates.append(CapacityGate(kind="capacity", name="capacity (implied)"))
    return gates


def _result(gate: str, passed: bool, value: float | None, op: str, threshold: float | None, detail: str) -> GateResult:
    return GateResult(gate=gate, kind="counter", passed=passed, value=value, op=op, threshold=threshold, detail=detail)


def speculation_gates(lane: Lane, engine: Engine, before: Metrics, after: Metrics, log: str,
                      requests: list[RequestRecord] | None = None) -> list[GateResult]:
    """After the counter gate's probe, for a drafter: the server's K against the declared K, and synthetic
    acceptance in the boot log. `requests`: the probe's (SGLang states its proposed drafts only there)."""
    if lane.drafter is None or engine.draft_counter is None:
        return []
    out: list[GateResult] = []
    declared_k = lane.speculative.k if lane.speculative else None
    window = engine.draft_window(before, after, requests or [])
    if not waived(lane, "draft-width") and window is not None:
        drafts, tokens = window
        effective_k = engine.effective_k(after) or engine.effective_k_of(requests or [])
        per_draft = tokens / drafts if drafts > 0 else None
        if declared_k is not None and effective_k is not None and effective_k != declared_k:
            out.append(_result("draft-width (implied)", False, float(effective_k), "==", float(declared_k),
                               f"declared K (speculative.k) = {declared_k}, but the server drafts up to "
                               f"{effective_k} tokens per verification step (its own counts: {tokens:g} draft "
                               f"tokens over {drafts:g} verify steps); fix: find the flag or engine default "
                               f"that sets the width, or declare k: {effective_k}"))
        elif declared_k is not None and per_draft is not None:
            ok = per_draft <= declared_k + 1e-9
            out.append(_result("draft-width (implied)", ok, per_draft, "<=", float(declared_k),
                               f"draft tokens per draft over the probe = {per_draft:.3g}, declared K = {declared_k}: "
                               f"{'passed' if ok else 'failed; fix: the server drafts wider than declared'}"))
    if not waived(lane, "synthetic") and (said := engine.invalid_speculation(log)):
        out.append(_result("synthetic (implied)", False, None, "==", None,
                           f"declared real speculation, but the server says: \"{said}\"; acceptance would be "
                           f"simulated, not measured; fix: remove --spec-synth-len / --spec-synth-rates from flags"))
    return out


def _name(path: Any) -> str:
    return Path(str(path)).name


def effective_findings(lane: Lane, facts: BootFacts, models: list[ModelFacts], identity: dict[str, str],
                       pinned: dict[str, str] | None) -> list[Finding]:
    """Declared against what the server resolved (boot log, /slots, preflight's hashes)."""
    out: list[Finding] = []
    cap = facts.max_running_requests
    if cap is not None and cap != lane.slots:
        out.append(Finding(check="slots", declared=lane.slots, effective=cap, severity="flag",
                           message=f"declared slots {lane.slots}, the server runs {cap} requests at once; "
                                   f"fix: set slots: {cap} or find the flag that changed it"))
    ctx = facts.context_per_slot
    if ctx is not None and ctx < lane.context:
        out.append(Finding(check="context", declared=lane.context, effective=ctx, severity="flag",
                           message=f"declared context {lane.context} tokens per slot, the server resolved {ctx}; "
                                   f"longer requests are cut or shifted; fix: set context: {ctx} or raise the "
                                   f"server's limit"))
    if lane.speculative is not None and facts.speculative_type:
        served = [t for t in facts.speculative_type.split(",") if t != "none"]
        if served and lane.speculative.method not in served:
            out.append(Finding(check="speculative type", declared=lane.speculative.method,
                               effective=facts.speculative_type, severity="failure",
                               message=f"declared speculative.method {lane.speculative.method}, the server runs "
                                       f"{facts.speculative_type}; fix: correct speculative.method or the flags"))
    loaded = facts.extra.get("draft_model")
    if lane.drafter is not None and loaded and _name(loaded) != _name(lane.drafter.path):
        out.append(Finding(check="drafter file", declared=_name(lane.drafter.path), effective=_name(loaded),
                           severity="failure", message=f"declared drafter {_name(lane.drafter.path)}, the server "
                           f"loaded {_name(loaded)}; fix: remove the flag that names another drafter"))
    temperature, top_k = facts.extra.get("temperature"), facts.extra.get("top_k")
    if (temperature is not None and float(temperature) > 0) or (top_k is not None and float(top_k) > 1):
        out.append(Finding(check="sampling", declared="greedy (temperature 0, top_k 1)",
                           effective=f"temperature {temperature}, top_k {top_k}", severity="failure",
                           message=f"lanebench measures greedy requests, the server ran temperature {temperature}, "
                                   f"top_k {top_k}: acceptance and outputs would not repeat; fix: remove the sampling "
                                   "override (flags or the engine's defaults)"))
    shas = {m.role: m.sha256 for m in models}
    if shas.get("drafter") and shas.get("drafter") == shas.get("model"):
        out.append(Finding(check="drafter is the target", declared=_name(lane.drafter.path if lane.drafter else ""),
                           effective=f"sha256 {str(shas['model'])[:12]}... (the target's)", severity="flag",
                           message="the drafter's sha256 equals the target's: acceptance near K+1 measures nothing "
                                   "about a drafter; fix: point drafter.path at the drafter file"))
    if pinned is not None and engine_for(lane.engine).pinned_build and lane.image is None:
        sha = identity.get("llama_server_sha256") or identity.get("sha256")
        if sha and sha != pinned.get("llama_server_sha256"):
            out.append(Finding(check="engine binary", declared=pinned.get("source", "the pinned build"),
                               effective=f"{identity.get('path')} (sha256 {sha[:12]}...)", severity="flag",
                               message=f"engine binary {identity.get('path')} is outside the pinned build "
                                       f"({pinned.get('source')}); no source pin is recorded for it; fix: drop "
                                       "'binary' to run the pinned build, or build it with scripts/build-llama-cpp.sh"))
    return out


def acceptance_findings(lane: Lane, rows: list[Any]) -> list[Finding]:
    """Acceptance too good to be true: within 5% of K+1 means the drafter is (nearly) the target."""
    out = []
    for row in rows:
        ceiling = row.k + 1
        best = max(row.acceptance_length, row.acceptance_length_full_steps or 0.0)  # budget-cut steps apart
        if best >= NEAR_PERFECT * ceiling:
            out.append(Finding(check="acceptance near K+1", declared=f"K={row.k} (at most {ceiling})",
                               effective=round(best, 3), severity="flag",
                               message=f"class {row.prompt_class}: acceptance length {best:.2f} at "
                                       f"K={row.k} is within {100 * (1 - NEAR_PERFECT):.0f}% of the ceiling {ceiling}: "
                                       "is the drafter the target? fix: check drafter.path and its sha256"))
        if not row.enough_prompts:
            out.append(Finding(check="probe set too small", declared=f"{row.prompts} prompts",
                               effective=f"at least {MIN_PROMPTS} for a verdict", severity="flag",
                               message=f"class {row.prompt_class}: {row.prompts} probe prompts; acceptance moves with "
                                       f"the probe set, so no verdict rests on fewer than {MIN_PROMPTS}; fix: "
                                       f"bench.acceptance.prompts_per_class: {MIN_PROMPTS} or more"))
        if row.drafted_share is not None and row.drafted_share < MIN_DRAFTED_SHARE:
            out.append(Finding(check="drafts skipped", declared="a draft at every decode step",
                               effective=f"{100 * row.drafted_share:.0f}% of decode steps drafted", severity="flag",
                               message=f"class {row.prompt_class}: acceptance length {row.acceptance_length:.2f} counts "
                                       f"only steps that carried a draft; over every decode step the target makes "
                                       f"{row.tokens_per_pass:.2f} tokens per forward pass (a draft probability floor, "
                                       f"--spec-draft-p-min, skips drafts); fix: quote tokens per target pass, or "
                                       f"set --spec-draft-p-min 0.0 to measure the drafter"))
        if row.truncated_share > 0:
            out.append(Finding(check="context truncation", declared="requests within the context",
                               effective=f"{100 * row.truncated_share:.0f}% ran into the context", severity="flag",
                               message=f"class {row.prompt_class}: {100 * row.truncated_share:.0f}% of probe requests "
                                       f"were cut or shifted by the server's context; fix: raise context or shorten "
                                       f"bench.acceptance.max_tokens"))
    return out


def pinned_identity(lane: Lane) -> dict[str, str] | None:
    """The pinned llama.cpp build's identity when the lane names its own binary, else None."""
    engine = engine_for(lane.engine)
    if not engine.pinned_build or lane.binary is None or lane.image is not None:
        return None
    try:
        return engine.local_build()[1]
    except BuildError:
        return None


def as_gate(finding: Finding) -> GateResult:
    return GateResult(gate=finding.check, kind="effective", passed=False, value=None, op="==", threshold=None,
                      detail=finding.message)


def noise_findings(lane: Lane, decode: list[Any], warmup: list[Any]) -> list[Finding]:
    """Unstable decode levels, single repeats, TTFT-dominated rows and warmup faster than steady: the host's noise."""
    out: list[Finding] = []
    if waived(lane, "unstable"):
        return out
    bound = lane.bench.unstable_spread_pct
    for row in decode:
        if row.unstable:
            out.append(Finding(check="unstable", declared=f"spread <= {bound:g}%",
                               effective=f"C={row.concurrency}: {row.aggregate_spread_pct:.0f}%", severity="flag",
                               message=f"decode C={row.concurrency}: repeats spread {row.aggregate_spread_pct:.0f}% "
                                       f"(bound {bound:g}%, host load {row.load_1m_before}, busy {row.busy_pct and round(row.busy_pct)}%, "
                                       f"steal {row.steal_pct and round(row.steal_pct, 1)}%): not a baseline; "
                                       "fix: re-run on a quiet host"))
    if decode and min(r.repeats for r in decode) < 2:
        out.append(Finding(check="one repeat", declared=f"repeats {min(r.repeats for r in decode)}",
                           effective="no spread to judge noise by", severity="flag",
                           message="decode levels measured once: their spread reads 0 and says nothing about "
                                   "noise; fix: bench.repeats: 3"))
    heavy = [f"C={r.concurrency} ({100 * r.ttft_share_p50:.0f}% of e2el)" for r in decode
             if r.ttft_share_p50 is not None and r.ttft_share_p50 > TTFT_DOMINATES]
    if heavy:
        out.append(Finding(check="ttft dominates", declared=f"decode max_tokens {lane.bench.decode.max_tokens}",
                           effective="; ".join(heavy), severity="flag",
                           message=f"decode rows where TTFT is over half the request's latency: {'; '.join(heavy)}: "
                                   "they measure prefill and queueing, not decode speed; fix: raise "
                                   "bench.decode.max_tokens"))
    # Every such row reads "noise" in the table; the lane is flagged when it is more than jitter.
    noisy = [f"C={r.concurrency} {r.size_class} ({r.first_hit_cost_s:+.3g} s)" for r in warmup
             if r.noise and -r.first_hit_cost_s > max(WARMUP_JITTER * r.steady_e2el_s, WARMUP_JITTER_S)]
    if noisy:
        out.append(Finding(check="warmup noise", declared="first hit slower than steady",
                           effective="; ".join(noisy), severity="flag",
                           message=f"warmup rows whose first hit was faster than steady: {'; '.join(noisy)}: "
                                   "host noise, not a negative cost; fix: re-run on a quiet host"))
    return out


def explain(result: GateResult, lane: Lane) -> GateResult:
    """An implied gate's failure in the user's terms: declared, effective, and the fix."""
    if result.passed or "(implied)" not in result.gate:
        return result
    if result.gate.startswith("drafts-happen"):
        how = ("declare speculative: {method: draft-simple, k: 4} (llama.cpp drafts only with --spec-type)"
               if lane.speculative is None else "check the speculative flags and the boot log")
        fix = (f"declared drafter {_name(lane.drafter.path if lane.drafter else '')}, effective drafts over the "
               f"probe: {result.value:g}; fix: {how}")
    elif result.gate.startswith("capacity"):
        wanted = max(lane.bench.decode.concurrency)
        fix = (f"declared bench concurrency up to {wanted} (slots {lane.slots}), effective running-request cap "
               f"{'unknown' if result.value is None else f'{result.value:g}'}; fix: lower bench.decode.concurrency "
               f"to the cap, or raise slots")
    else:
        return result
    return result.model_copy(update={"detail": f"{result.detail}; {fix}"})
