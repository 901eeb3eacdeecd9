"""Boot gates: checks on the booted server that must pass before anything is measured.

- Counter gate: a patched verify path once never ran (`steps=0 fallback_full_width=4097`) and
  passed every output-equality check; a drafter loaded without speculation drafts nothing.
- Capacity gate: a state cache capped a server at 7 running requests while the bench asked
  for 16, and the table reported 16.
"""

from __future__ import annotations

import operator
import re

import httpx
from prefect import task
from prefect.cache_policies import NO_CACHE
from prefect.tasks import exponential_backoff

from tasks.client.control import control
from tasks.serving.live import Endpoint
from tasks.inventory.models import CapacityGate, CounterGate, Lane
from tasks.engines import engine_for
from tasks.client.load import Wave, run_wave
from tasks.client.prompts import Prompt
from tasks.wire.records import RequestRecord
from tasks.engines.facts import BootFacts, Metrics
from tasks.record.rows import GateResult, InFlight

_OPS = {">": operator.gt, ">=": operator.ge, "<": operator.lt, "<=": operator.le, "==": operator.eq, "!=": operator.ne}


class TransientFault(RuntimeError):
    """A fault worth retrying: connection refused, HTTP 5xx."""


class GateFailed(RuntimeError):
    def __init__(self, result: GateResult) -> None:
        self.result = result
        super().__init__(f"gate {result.gate!r} failed: {result.detail}")


def _transient(task, task_run, state) -> bool:
    return isinstance(state.result(raise_on_failure=False), TransientFault)


@task(name="scrape-metrics", cache_policy=NO_CACHE, retries=3, retry_delay_seconds=exponential_backoff(0.5),
      retry_condition_fn=_transient)
def scrape_metrics(endpoint: Endpoint) -> Metrics:
    engine = engine_for(endpoint.engine)
    try:
        r = control().get(endpoint.base_url + engine.metrics_path, timeout=10.0)
    except httpx.TransportError as e:
        raise TransientFault(f"metrics scrape: {type(e).__name__}") from e
    if r.status_code >= 500:
        raise TransientFault(f"metrics scrape: HTTP {r.status_code}")
    r.raise_for_status()
    return engine.metrics(r.text)


@task(name="probe-request", cache_policy=NO_CACHE, retries=3, retry_delay_seconds=exponential_backoff(0.5),
      retry_condition_fn=_transient)
def probe_request(endpoint: Endpoint, prompt: Prompt, max_tokens: int = 32) -> RequestRecord:
    """One short request; HTTP 5xx and refused connections are retried with backoff."""
    wave = Wave(lane=endpoint.lane, stage="probe", repeat=0, concurrency=1, requests_per_stream=1,
                max_tokens=max_tokens)
    record = run_wave(endpoint.base_url, engine_for(endpoint.engine), wave, [prompt]).records[0]
    if not record.ok and (record.http_status is None or record.http_status >= 500):
        raise TransientFault(f"probe request failed: {record.error}")
    if not record.ok:
        raise RuntimeError(f"probe request refused: {record.error}")
    return record


def judge(name: str, kind: str, value: float | None, op: str, threshold: float | None, what: str) -> GateResult:
    passed = value is not None and threshold is not None and _OPS[op](value, threshold)
    shown = "no value" if value is None else f"{value:g}"
    verdict = "passed" if passed else "failed"
    return GateResult(gate=name, kind=kind, passed=passed, value=value, op=op, threshold=threshold,
                      detail=f"{what} = {shown}, required {op} {threshold:g}: {verdict}")


@task(name="counter-gate", cache_policy=NO_CACHE)
def counter_gate(gate: CounterGate, endpoint: Endpoint, lane: Lane, probe: Prompt,
                 facts: BootFacts | None = None) -> tuple[GateResult, RequestRecord]:
    """Send a probe request, then read the counter (a metric's increase over the probe, or a log value);
    returns the result and the probe's record. With the boot facts the counters are one more source:
    a drafter said loaded whose counter never moved is named in the detail."""
    before = scrape_metrics(endpoint)
    sent = probe_request(endpoint, probe)
    after = scrape_metrics(endpoint)
    if gate.metric is not None:
        value: float | None = after.total(gate.metric) - before.total(gate.metric)
        what = f"increase of metric {gate.metric} over the probe"
    else:
        matches = list(re.finditer(gate.log_pattern or "", endpoint.log()))
        value = float(matches[-1]["value"]) if matches else None
        what = f"log counter /{gate.log_pattern}/ (last match)"
    result = judge(gate.name, "counter", value, gate.op, gate.threshold, what)
    result.requests = [InFlight(started_at=sent.started_at, seconds=sent.e2el_s or 0.0)]
    if facts is not None and lane.speculative is not None and gate.metric is not None and "spec" in gate.metric:
        return cross_check_drafts(result, facts, drafted=bool(value and value > 0)), sent
    return result, sent


def cross_check_drafts(result: GateResult, facts: BootFacts, drafted: bool) -> GateResult:
    """Counters as a source of "the drafter is there": noted in the facts, disagreement in the detail."""
    facts.note("draft_model_loaded", "counters", drafted)
    facts.reconcile()
    said = {s: v for s, v in facts.sources.get("draft_model_loaded", {}).items() if s != "counters"}
    if said and any(said.values()) and not drafted:
        shown = ", ".join(f"{s} says loaded" for s, v in sorted(said.items()) if v)
        return result.model_copy(update={"detail": f"{result.detail} ({shown}; the counters say it never drafted)"})
    return result


def conservative_cap(facts: BootFacts) -> tuple[int | None, str]:
    """The lowest running-request cap any source stated, and why that one."""
    readings = {s: v for s, v in facts.sources.get("max_running_requests", {}).items() if isinstance(v, int)}
    if not readings:
        return facts.max_running_requests, "boot log"
    source = min(readings, key=lambda s: readings[s])
    if len(set(readings.values())) > 1:
        shown = ", ".join(f"{s} {v}" for s, v in sorted(readings.items()))
        return readings[source], f"{source}, the lowest of {shown}"
    return readings[source], " and ".join(sorted(readings))


@task(name="capacity-gate", cache_policy=NO_CACHE)
def capacity_gate(gate: CapacityGate, lane: Lane, facts: BootFacts) -> GateResult:
    """The bench's highest concurrency must fit the running-request cap (per worker x data-parallel
    workers, the lowest source); `beyond_cap: queue` levels are let through (measured as a queue)."""
    queued = lane.bench.decode.queue_levels()
    wanted = max(lane.bench.decode.gated_levels())
    cap, why = conservative_cap(facts)
    if cap is None:
        return GateResult(gate=gate.name, kind="capacity", passed=False, value=None, op=">=", threshold=float(wanted),
                          detail=f"the boot log states no running-request cap; bench concurrency {wanted} cannot be checked")
    workers = facts.parallel.get("dp_workers", 1)
    shape = f", {workers} data-parallel workers" if workers > 1 else ""
    note = f"; declared beyond_cap queue levels {queued} run as queueing" if queued else ""
    if line := facts.extra.get("cap_line"):
        note += f"; the server's own line: {line!r}"
    return judge(gate.name, "capacity", float(cap), ">=", float(wanted),
                 f"running-request cap from {why}{shape} (bench concurrency up to {wanted}{note})")
