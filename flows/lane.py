"""The lane flow: one serving configuration, from preflight to validated results.

    preflight (links, host, workers, files, port) -> image pull by digest -> boot
              -> boot gates (declared, agentic smoke, thinking switch) -> capacity plan -> warmup
              -> decode curve (+ queueing levels past the cap) -> prefill ladder -> acceptance probe
              -> tool gate -> needle ladder -> accuracy eval
              -> expectations -> artifacts            (teardown on every path)

A failed precondition skips the lane with its reason; a failed boot gate stops it, naming gate,
value and threshold; a failed correctness gate fails it after its tables are kept; a table that
fails its expectations is quarantined and fails it. The caller's `StagePlan` picks the optional
stages (a matrix arm: speed only); boot gates and expectations always run. `_ended_by` alone
turns whatever ended the lane into its status and reason.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from prefect import flow, get_run_logger
from prefect.states import Completed, Failed, State
from pydantic import BaseModel, ConfigDict

from tasks.client.metrics import SERVER_AGREE_PCT
from tasks.client.prompts import Prompt, load_prompts
from tasks.correctness import record as correctness
from tasks.correctness.accuracy import accuracy_eval, in_words
from tasks.engines import engine_for
from tasks.stages.capacity import capacity_plan, typical_tokens
from tasks.stages.prefill import prefill_ladder
from tasks.stages.queueing import queueing_levels
from tasks.correctness.needles import needle_ladder
from tasks.correctness.tool_gate import tool_gate
from tasks.inventory.models import Host, Inventory, Lane
from tasks.inventory import secrets
from tasks.record.expectations import warmed_up
from tasks.record.fingerprint import fingerprint
from tasks.record.manifest import Bandwidth
from tasks.record.interrupted import stop_requested
from tasks.record.rows import DecodeRow, Finding, GateResult, WarmupRow
from tasks.record.run_folder import LaneRecord, RunFolder, RunFolderWriteError
from tasks.stages.acceptance import acceptance_probe, draft_shape
from tasks.serving import live
from tasks.stages.boot import NodeLost
from tasks.serving.deadlines import ServerDied
from tasks.stages.decode_curve import decode_curve
from tasks.stages.gates import GateFailed, conservative_cap
from tasks.stages.limits import with_bandwidth_share
from tasks.inventory.paths import resolve
from tasks.stages.safety import acceptance_findings, noise_findings
from tasks.stages.serve import Served, served_lane
from tasks.stages.warmup import warmup


class StagePlan(BaseModel):
    """The optional stages, each still only where the lane declares it."""

    model_config = ConfigDict(frozen=True)

    speed: bool = True  # capacity plan, warmup, decode curve (+ queueing levels), acceptance probe
    prefill: bool = True  # prefill ladder
    tool_gate: bool = True
    needles: bool = True  # needle ladder
    accuracy: bool = True  # accuracy eval
    held_out: bool = False  # the held-out tool suite, only ever when asked (`lanebench tools --held-out`)


NIGHTLY = StagePlan()
MATRIX_ARM = StagePlan(prefill=False, tool_gate=False, needles=False, accuracy=False)
TOOLS = StagePlan(speed=False, prefill=False, needles=False, accuracy=False)  # boot, boot gates, tool gate


@dataclass
class _Prompts:
    decode: list[Prompt]
    classes: dict[str, list[Prompt]]  # the acceptance probe's prompt classes

    @property
    def probe(self) -> Prompt:
        """The shortest prompt: what a counter gate sends."""
        return min([*self.decode, *(p for ps in self.classes.values() for p in ps)], key=lambda p: len(p.text))


def _prompt_sets(lane: Lane, base_dir: Path) -> _Prompts:
    plan = lane.bench.acceptance
    classes = {c: load_prompts(resolve(base_dir, p), plan.prompts_per_class) for c, p in plan.classes.items()} if plan else {}
    return _Prompts(load_prompts(resolve(base_dir, lane.bench.decode.prompts)), classes)


@flow(name="lane", flow_run_name="lane-{lane_name}")
def lane_flow(lane_name: str, lane: Lane, host: Host, base_dir: Path, run_dir: str,
              stages: StagePlan = NIGHTLY, inventory: Inventory | None = None) -> State:
    run = RunFolder.opened(run_dir)
    record = run.lane(lane_name)
    lane = secrets.reveal(lane_name, lane)  # the real values: this process only, never a parameter
    record.config = secrets.redact(lane).model_dump(mode="json")
    prompts = _prompt_sets(lane, base_dir)
    try:
        # 1-4. Preflight, image pull, boot, boot gates; teardown when the block ends, whatever happens.
        with served_lane(run, lane_name, lane, host, base_dir, inventory, prompts.probe) as served:
            if served is None:  # skipped by a precondition, or its pinned image cannot be had
                get_run_logger().warning("lane %s %s: %s", lane_name, record.status, record.reason)
                return Completed(name="Skipped", message=record.reason) if record.status == "skipped" \
                    else Failed(message=record.reason)
            on = _OnServer(run, record, served, host, base_dir, prompts, stages)
            if stages.speed:
                on.measure()
            return on.correctness()
    except Exception as e:
        return _ended_by(lane_name, record, e)
    finally:
        try:
            correctness.write(run, lane_name)
        except Exception as e:  # a view of the verdicts and tables; losing it must not lose the lane
            record.warnings.append(f"correctness.md: {type(e).__name__}: {e}")
        run.save_manifest()


def _ended_by(lane_name: str, record: LaneRecord, e: Exception) -> State:
    """The one place an exception becomes the lane's status and reason, with its stage; it fails this lane, not the run."""
    where = record.stopped_in()
    if isinstance(e, GateFailed):  # names gate, value and threshold itself
        reason = str(e)
    elif isinstance(e, (NodeLost, ServerDied)):  # named as what it is
        reason = f"{where}: {e}"
    elif isinstance(e, RunFolderWriteError):  # disk full: one line, the records so far kept
        reason = f"{where}: {e.strerror}"
    elif stop_requested():  # Ctrl-C/SIGTERM, whatever Prefect turned it into on its way here
        record.status, record.reason = "interrupted", f"{where}: interrupted by {stop_requested()}"
        return Failed(name="Interrupted", message=record.reason)
    else:
        reason = secrets.scrub(f"{where}: {type(e).__name__}: {e}")
    record.status, record.reason = "failed", reason
    get_run_logger().error("lane %s failed: %s", lane_name, reason)
    return Failed(message=reason)


@dataclass
class _OnServer:
    """The stages that run on the booted server, in the recipe's order."""

    run: RunFolder
    record: LaneRecord
    served: Served
    host: Host
    base_dir: Path
    prompts: _Prompts
    stages: StagePlan

    @property
    def name(self) -> str:
        return self.served.name

    @property
    def lane(self) -> Lane:  # as its host serves it
        return self.served.lane

    def stage(self, name: str) -> None:
        if dead := self.served.server.dead_workers():  # a lane across hosts lost a node
            raise NodeLost(f"{'; '.join(dead)} (a worker of this lane across hosts is gone)")
        if self.run.write_error is not None:
            raise RunFolderWriteError(28, self.run.write_error)
        self.run.stage(self.name, name)

    def measure(self) -> None:
        """4b-7: capacity plan, warmup, decode curve (+ queueing), prefill ladder, acceptance probe."""
        self.capacity_plan()
        rows = self.decode_curve(self.warmup())
        if self.stages.prefill and self.lane.bench.prefill is not None:
            self.prefill_ladder()
        for row in rows:
            if row.client_saturated:
                self.record.warnings.append(
                    f"decode {row.load_shape}: the client could not keep its clocks (event-loop lag p99 "
                    f"{1e3 * (row.client_loop_lag_p99_s or 0):.1f} ms, client CPU {row.client_cpu or 0:.2f} "
                    "cores): busy with its own work or starved by the host, it may have added its delay")
            if row.server_gap_pct is not None and abs(row.server_gap_pct) > SERVER_AGREE_PCT:
                self.record.warnings.append(
                    f"decode {row.load_shape}: aggregate {row.aggregate_tok_s:.1f} tok/s is {row.server_gap_pct:+.1f} % "
                    f"from the server's own timings ({row.server_tok_s:.1f} tok/s; bound {SERVER_AGREE_PCT:g} %)")
        if self.lane.speculative is not None and self.lane.bench.acceptance is not None:
            self.acceptance_probe()

    def capacity_plan(self) -> None:
        """4b. Users x context each, from the boot facts: a concurrency that does not fit the pool is flagged first."""
        if self.lane.bench.capacity is None:
            return
        self.stage("capacity plan")
        typical = typical_tokens(self.lane, self.served.endpoint.base_url, engine_for(self.lane.engine),
                                 self.prompts.decode)
        cap_rows, check = capacity_plan(self.name, self.lane, self.served.facts, typical)
        self.run.write_table(self.name, "capacity", cap_rows)
        self.record.capacity = check.model_dump(mode="json")
        if not check.fits:
            self.record.warnings.append(check.warning)
        self.run.save_manifest()

    def warmup(self) -> list[WarmupRow]:
        """5. Every batch shape a bench will use, first hit recorded apart."""
        self.stage("warmup")
        warmed_up()  # GX and matplotlib finish loading before the first measured request
        lane, endpoint = self.lane, self.served.endpoint
        shapes = [(c, "decode", lane.bench.decode.max_tokens) for c in lane.bench.decode.concurrency]
        if lane.bench.acceptance is not None:
            shapes += [(1, c, lane.bench.acceptance.max_tokens) for c in self.prompts.classes]
        warm = warmup(endpoint, str(self.run.path), shapes, {"decode": self.prompts.decode, **self.prompts.classes})
        self.run.write_table(self.name, "warmup", warm)
        live.check(endpoint)  # a fault in the last warmup wave is the warmup's
        return warm

    def decode_curve(self, warm: list[WarmupRow]) -> list[DecodeRow]:
        """6. Repeats at each concurrency level, median and spread; `beyond_cap: queue` levels past the cap after it."""
        self.stage("decode curve")
        lane, endpoint, record, run_dir = self.lane, self.served.endpoint, self.record, str(self.run.path)
        live.check(endpoint)
        cap, _ = conservative_cap(self.served.facts)
        past_cap = [c for c in lane.bench.decode.queue_levels() if cap is None or c > cap]
        for level in sorted(set(lane.bench.decode.queue_levels()) - set(past_cap)):
            record.warnings.append(f"beyond_cap: level {level} fits the server's cap of {cap}: "
                                   "measured as an ordinary level")
        plan = lane.bench.decode.model_copy(update={"concurrency": [c for c in lane.bench.decode.concurrency
                                                                    if c not in past_cap]})
        rows = decode_curve(endpoint, run_dir, plan, lane.bench.repeats, self.prompts.decode,
                            unstable_spread_pct=lane.bench.unstable_spread_pct)
        live.check(endpoint)  # the last wave's requests past their deadline end the lane here, not in a table
        model_bytes = next((m.bytes for m in record.models if m.role == "model"), None)
        rows = with_bandwidth_share(rows, model_bytes, self.host.memory_gbps)
        if model_bytes and self.host.memory_gbps:
            record.bandwidth = Bandwidth(model_bytes=model_bytes, memory_gbps=self.host.memory_gbps)
        queue_rows: list = []
        if past_cap:
            self.stage("queueing levels")
            # Its records are kept, not judged against the wall deadline: a queued request may wait long.
            queued, queue_rows = queueing_levels(endpoint, run_dir, lane.bench.decode, lane.bench.repeats,
                                                 self.prompts.decode, past_cap, cap, rows)
            rows = sorted([*rows, *queued], key=lambda r: r.concurrency)
        self.run.write_table(self.name, "decode", rows)
        if queue_rows:
            self.run.write_table(self.name, "queueing", queue_rows)
        # Noise made visible: unstable levels and warmup faster than steady (tasks/stages/safety.py).
        record.flags += noise_findings(lane, rows, warm)
        return rows

    def prefill_ladder(self) -> None:
        """6b. Cold, nonce-led prompts from short to the longest the server holds."""
        self.stage("prefill ladder")
        pre = self.lane.bench.prefill
        assert pre is not None
        filler = load_prompts(resolve(self.base_dir, pre.prompts)) if pre.prompts else self.prompts.decode
        ladder = prefill_ladder(self.served.endpoint, str(self.run.path), pre, self.served.facts, self.lane.context,
                                filler)
        self.record.warnings += [f"prefill ladder: rung {row.rung} {row.status}: {row.reason}"
                                 for row in ladder if row.status != "measured"]
        self.run.write_table(self.name, "prefill", ladder)

    def acceptance_probe(self) -> None:
        """7. Per prompt class, counter deltas over the probe window only."""
        self.stage("acceptance probe")
        lane, endpoint = self.lane, self.served.endpoint
        assert lane.speculative is not None and lane.bench.acceptance is not None
        acc_rows, silent = acceptance_probe(endpoint, str(self.run.path), lane.speculative.k, self.prompts.classes,
                                            lane.bench.acceptance.max_tokens, lane.bench.repeats,
                                            engine_for(lane.engine).acceptance_log_interval_s(lane.env),
                                            draft_shape(lane.engine, self.served.server.argv))
        live.check(endpoint)
        self.record.warnings += [f"acceptance probe: class {c} had no verification step" for c in silent]
        self.record.flags += acceptance_findings(lane, acc_rows)
        if acc_rows:
            self.run.write_table(self.name, "acceptance", acc_rows)

    def correctness(self) -> State:
        """8-9. Tool gate, needle ladder (tables kept whatever the verdict), accuracy eval; then expectations."""
        lane, run, record, endpoint = self.lane, self.run, self.record, self.served.endpoint
        checks = lane.correctness
        verdicts: list[GateResult] = []
        if self.stages.tool_gate and checks is not None and checks.tool_gate is not None:
            self.stage("tool gate")
            verdicts += tool_gate(endpoint, str(run.path), lane, self.host, self.base_dir, self.stages.held_out)
            record.flags += [Finding(check="tool score truncated", declared="a score of finished answers",
                                     effective=r.detail.split("; ")[-1], severity="flag",
                                     message=f"{r.gate}: {r.detail}; fix: raise the protocol's max_tokens")
                             for r in verdicts if "dominated by truncation" in r.detail]
        if self.stages.needles and checks is not None and checks.needles is not None:
            self.stage("needle ladder")
            ladder = needle_ladder(endpoint, str(run.path), lane)
            verdicts += [ladder] if ladder is not None else []
        with run.edit():
            correctness.verdicts(run, self.name).extend(verdicts)
        if self.stages.accuracy and lane.bench.accuracy is not None:
            # A report, not a gate: the raw score only ever beside the share cut off at max_tokens.
            self.stage("accuracy eval")
            scores = accuracy_eval(endpoint, str(run.path), lane, resolve(self.base_dir, lane.bench.accuracy.file))
            if (words := in_words(scores)).startswith("TRUNCATION DOMINATES"):
                record.warnings.append(f"accuracy eval: {words}")
            run.save_manifest()
        return self.expectations(verdicts)

    def expectations(self, verdicts: list[GateResult]) -> State:
        """The lane's verdict: a quarantined table or a failed gate fails it."""
        run, record = self.run, self.record
        record.fingerprint = fingerprint(record, run.manifest.host, self.base_dir)  # comparisons hold it equal
        self.stage("expectations")
        run.validate_raw(self.name, "requests.jsonl", "requests")
        failed = [e for e in run.manifest.artifacts if e.lane == self.name and e.validation == "failed"]
        if failed:
            kinds = ", ".join(sorted({e.kind for e in failed}))
            record.status, record.reason = "failed", f"expectations failed for {kinds}; results quarantined"
            return Failed(message=record.reason)
        if failed_gate := next((r for r in verdicts if not r.passed), None):
            record.status, record.reason = "failed", str(GateFailed(failed_gate))
            return Failed(message=record.reason)
        record.status = "passed"
        return Completed(message="passed")
