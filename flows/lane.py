"""The lane flow: one serving configuration, from preflight to validated results.

    preflight (links, host, workers, files, port) -> image pull by digest -> boot
              -> boot gates (declared, agentic smoke, thinking switch) -> capacity plan -> warmup
              -> decode curve (+ queueing levels past the cap) -> prefill ladder -> acceptance probe
              -> tool gate -> needle ladder -> accuracy eval
              -> expectations -> artifacts            (teardown on every path)

Read it as the recipe the seeds did by hand. A failed precondition skips the lane with its
reason; a failed boot gate stops the lane's measurements and names gate, value and threshold;
a failed correctness gate (tool gate, needle ladder) fails the lane after its tables are kept;
a table that fails its expectations is quarantined and fails the lane.

`stages="tools"` (used by `lanebench tools`) boots, runs the boot gates and the tool gate
only; `held_out=True` adds the held-out tool suite. Matrix arms skip the tool gate and the
needle ladder, and the prefill ladder and accuracy eval (`SPEED_ONLY_FLOWS`).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Literal

from prefect import flow, get_run_logger
from prefect.states import Completed, Failed, State

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
from tasks.record.interrupted import stop_requested
from tasks.record.rows import GateResult
from tasks.record.run_folder import LaneRecord, RunFolder, RunFolderWriteError
from tasks.stages.acceptance import acceptance_probe, draft_shape
from tasks.serving import live
from tasks.stages.boot import NodeLost
from tasks.serving.deadlines import ServerDied
from tasks.stages.decode_curve import decode_curve
from tasks.stages.gates import GateFailed, conservative_cap
from tasks.stages.limits import with_bandwidth_share
from tasks.serving.live import Endpoint
from tasks.stages.preflight import resolve
from tasks.stages.safety import acceptance_findings, noise_findings
from tasks.stages.serve import served_lane
from tasks.stages.warmup import warmup


# Flows whose lanes are speed measurements of one target under many arms (drafter x K): the
# target's tool gate and needle ladder are the nightly's and `lanebench tools`' business, and
# would cost every arm a minute. The agentic boot gates still run (they are seconds).
SPEED_ONLY_FLOWS = frozenset({"matrix"})


def _prompt_sets(lane: Lane, base_dir: Path) -> tuple[list[Prompt], dict[str, list[Prompt]]]:
    decode = load_prompts(resolve(base_dir, lane.bench.decode.prompts))
    classes: dict[str, list[Prompt]] = {}
    if lane.bench.acceptance is not None:
        plan = lane.bench.acceptance
        classes = {c: load_prompts(resolve(base_dir, p), plan.prompts_per_class) for c, p in plan.classes.items()}
    return decode, classes


@flow(name="lane", flow_run_name="lane-{lane_name}")
def lane_flow(lane_name: str, lane: Lane, host: Host, base_dir: Path, run_dir: str,
              stages: Literal["all", "tools"] = "all", held_out: bool = False,
              inventory: Inventory | None = None) -> State:
    logger = get_run_logger()
    run = RunFolder.opened(run_dir)
    record = run.lane(lane_name)
    lane = secrets.reveal(lane_name, lane)  # the real values: this process only, never a parameter
    record.config = secrets.redact(lane).model_dump(mode="json")

    served = None

    def stage(name: str) -> None:
        if served is not None and (dead := served.server.dead_workers()):  # a lane across hosts lost a node
            raise NodeLost(f"{'; '.join(dead)} (a worker of this lane across hosts is gone)")
        if run.write_error is not None:
            raise RunFolderWriteError(28, run.write_error)
        run.stage(lane_name, name)

    decode_prompts, class_prompts = _prompt_sets(lane, base_dir)
    probe = min([*decode_prompts, *(p for ps in class_prompts.values() for p in ps)], key=lambda p: len(p.text))
    # The stages' tasks take the server's endpoint and the run folder's path; each keeps its raw
    # records in `requests.jsonl` and checks the server between waves itself (tasks/serving/live.py):
    # a request past its wall deadline ends the lane at the next check, naming it.
    try:
        # 1-4. Preflight, image pull, boot, boot gates; teardown when the block ends, whatever happens.
        with served_lane(run, lane_name, lane, host, base_dir, inventory, probe) as served:
            if served is None:  # skipped by a precondition, or its pinned image cannot be had
                logger.warning("lane %s %s: %s", lane_name, record.status, record.reason)
                if record.status == "skipped":
                    return Completed(name="Skipped", message=record.reason)
                return Failed(message=record.reason)
            endpoint, lane = served.endpoint, served.lane

            if stages == "tools":
                return _correctness(run, record, lane, host, base_dir, endpoint, stage, held_out, needles=False)

            # 4b. Capacity plan: users x context each, from the boot facts; a declared concurrency whose
            # typical requests do not fit the pool is flagged here, before any curve runs on it.
            if lane.bench.capacity is not None:
                stage("capacity plan")
                typical = typical_tokens(lane, endpoint.base_url, engine_for(lane.engine), decode_prompts)
                cap_rows, check = capacity_plan(lane_name, lane, served.facts, typical)
                run.write_table(lane_name, "capacity", cap_rows)
                record.capacity = check.model_dump()
                if not check.fits:
                    record.warnings.append(check.warning)
                run.save_manifest()

            # 5. Warmup: every batch shape a bench will use, first hit recorded apart.
            stage("warmup")
            warmed_up()  # GX and matplotlib finish loading before the first measured request
            shapes = [(c, "decode", lane.bench.decode.max_tokens) for c in lane.bench.decode.concurrency]
            if lane.bench.acceptance is not None:
                shapes += [(1, c, lane.bench.acceptance.max_tokens) for c in class_prompts]
            warm = warmup(endpoint, run_dir, shapes, {"decode": decode_prompts, **class_prompts})
            run.write_table(lane_name, "warmup", warm)
            live.check(endpoint)  # a fault in the last warmup wave is the warmup's

            # 6. Decode curve: repeats at each concurrency level, median and spread. Levels declared
            # `beyond_cap: queue` that exceed the server's cap run after it, labelled "queueing".
            stage("decode curve")
            live.check(endpoint)
            cap, _ = conservative_cap(served.facts)
            past_cap = [c for c in lane.bench.decode.queue_levels() if cap is None or c > cap]
            for level in sorted(set(lane.bench.decode.queue_levels()) - set(past_cap)):
                record.warnings.append(f"beyond_cap: level {level} fits the server's cap of {cap}: "
                                       "measured as an ordinary level")
            plan = lane.bench.decode.model_copy(update={"concurrency": [c for c in lane.bench.decode.concurrency
                                                                        if c not in past_cap]})
            rows = decode_curve(endpoint, run_dir, plan, lane.bench.repeats, decode_prompts,
                                unstable_spread_pct=lane.bench.unstable_spread_pct)
            live.check(endpoint)  # the last wave's requests past their deadline end the lane here, not in a table
            model_bytes = next((m["bytes"] for m in record.models if m["role"] == "model"), None)
            rows = with_bandwidth_share(rows, model_bytes, host.memory_gbps)
            if model_bytes and host.memory_gbps:
                record.bandwidth = {"model_bytes": model_bytes, "memory_gbps": host.memory_gbps}
            queue_rows = []
            if past_cap:
                stage("queueing levels")
                # Its records are kept, not judged against the wall deadline: a queued request may wait long.
                queued, queue_rows = queueing_levels(endpoint, run_dir, lane.bench.decode, lane.bench.repeats,
                                                     decode_prompts, past_cap, cap, rows)
                rows = sorted([*rows, *queued], key=lambda r: r.concurrency)
            run.write_table(lane_name, "decode", rows)
            if queue_rows:
                run.write_table(lane_name, "queueing", queue_rows)
            # Noise made visible: unstable levels and warmup faster than steady (tasks/stages/safety.py).
            record.flags += [f.model_dump(mode="json") for f in noise_findings(lane, rows, warm)]

            # 6b. Prefill ladder: cold, nonce-led prompts from short to the longest the server holds.
            if lane.bench.prefill is not None and run.manifest.flow.get("name") not in SPEED_ONLY_FLOWS:
                stage("prefill ladder")
                pre = lane.bench.prefill
                filler = load_prompts(resolve(base_dir, pre.prompts)) if pre.prompts else decode_prompts
                ladder = prefill_ladder(endpoint, run_dir, pre, served.facts, lane.context, filler)
                for row in ladder:
                    if row.status != "measured":
                        record.warnings.append(f"prefill ladder: rung {row.rung} {row.status}: {row.reason}")
                run.write_table(lane_name, "prefill", ladder)
            # The load shape is in the lane's config (bench.decode) and in each row's load_shape.
            for row in rows:
                if row.client_saturated:
                    record.warnings.append(
                        f"decode {row.load_shape}: the client could not keep its clocks (event-loop lag p99 "
                        f"{1e3 * (row.client_loop_lag_p99_s or 0):.1f} ms, client CPU {row.client_cpu or 0:.2f} "
                        "cores): busy with its own work or starved by the host, it may have added its delay")

            # 7. Acceptance probe: per prompt class, counter deltas over the probe window only.
            if lane.speculative is not None and lane.bench.acceptance is not None:
                stage("acceptance probe")
                acc_rows, silent = acceptance_probe(endpoint, run_dir, lane.speculative.k, class_prompts,
                                                    lane.bench.acceptance.max_tokens, lane.bench.repeats,
                                                    engine_for(lane.engine).acceptance_log_interval_s(lane.env),
                                                    draft_shape(lane.engine, served.server.argv))
                live.check(endpoint)
                for prompt_class in silent:
                    record.warnings.append(f"acceptance probe: class {prompt_class} had no verification step")
                record.flags += [f.model_dump(mode="json") for f in acceptance_findings(lane, acc_rows)]
                if acc_rows:
                    run.write_table(lane_name, "acceptance", acc_rows)

            # 8-9. Correctness on the same booted server: tool-call gate, needle ladder; then
            # expectations on the raw records too. Any failed suite or gate fails the lane.
            if run.manifest.flow.get("name") in SPEED_ONLY_FLOWS:
                return _correctness(run, record, lane.model_copy(update={"correctness": None}), host, base_dir,
                                    endpoint, stage, held_out, needles=False)
            return _correctness(run, record, lane, host, base_dir, endpoint, stage, held_out, needles=True)
    except GateFailed as e:
        record.status, record.reason = "failed", str(e)
        return Failed(message=str(e))
    except NodeLost as e:
        record.status, record.reason = "failed", f"{_failed_in(record)}: {e}"
        logger.error("lane %s failed in %s: %s", lane_name, _failed_in(record), e)
        return Failed(message=record.reason)
    except ServerDied as e:  # named as what it is, with the stage it happened in
        record.status, record.reason = "failed", f"{_failed_in(record)}: {e}"
        return Failed(message=record.reason)
    except RunFolderWriteError as e:  # disk full: one line, the records so far kept
        record.status, record.reason = "failed", f"{_failed_in(record)}: {e.strerror}"
        return Failed(message=record.reason)
    except Exception as e:  # a crashed stage fails this lane, not the run
        if stop_requested():  # Ctrl-C/SIGTERM, whatever Prefect turned it into on its way here
            record.status, record.reason = "interrupted", f"{_failed_in(record)}: interrupted by {stop_requested()}"
            return Failed(name="Interrupted", message=record.reason)
        record.status, record.reason = "failed", secrets.scrub(f"{_failed_in(record)}: {type(e).__name__}: {e}")
        logger.error("lane %s failed in %s: %s", lane_name, _failed_in(record), record.reason)
        return Failed(message=record.reason)
    finally:
        try:
            correctness.write(run, lane_name)
        except Exception as e:  # a view of the verdicts and tables; losing it must not lose the lane
            record.warnings.append(f"correctness.md: {type(e).__name__}: {e}")
        run.save_manifest()


def _failed_in(record: LaneRecord) -> str:
    """The stage a failure happened in: teardown has run by the time the error reaches the flow."""
    stages = [m.stage for m in record.timeline if m.stage not in ("teardown", "done")]
    return stages[-1] if stages else record.stage


def _correctness(run: RunFolder, record: LaneRecord, lane: Lane, host: Host, base_dir: Path, endpoint: Endpoint,
                 stage: Callable[[str], None], held_out: bool, needles: bool) -> State:
    """Tool gate and needle ladder (their tables kept whatever the verdict), then expectations."""
    lane_name, run_dir = endpoint.lane, str(run.path)
    verdicts: list[GateResult] = []
    if lane.correctness is not None and lane.correctness.tool_gate is not None:
        stage("tool gate")
        verdicts += tool_gate(endpoint, run_dir, lane, host, base_dir, held_out)
        record.flags += [{"check": "tool score truncated", "declared": "a score of finished answers",
                          "effective": r.detail.split("; ")[-1], "severity": "flag",
                          "message": f"{r.gate}: {r.detail}; fix: raise the protocol's max_tokens"}
                         for r in verdicts if "dominated by truncation" in r.detail]
    if needles and lane.correctness is not None and lane.correctness.needles is not None:
        stage("needle ladder")
        ladder = needle_ladder(endpoint, run_dir, lane)
        verdicts += [ladder] if ladder is not None else []
    correctness.verdicts(run, lane_name).extend(r.model_dump() for r in verdicts)
    run.save_manifest()
    if needles and lane.bench.accuracy is not None:
        # A report, not a gate: the raw score only ever beside the share cut off at max_tokens.
        stage("accuracy eval")
        scores = accuracy_eval(endpoint, run_dir, lane, resolve(base_dir, lane.bench.accuracy.file))
        words = in_words(scores)
        if words.startswith("TRUNCATION DOMINATES"):
            record.warnings.append(f"accuracy eval: {words}")
        run.save_manifest()

    record.fingerprint = fingerprint(record, run.manifest.host, base_dir)  # comparisons hold it equal
    stage("expectations")
    run.validate_raw(lane_name, "requests.jsonl", "requests")
    failed = [e for e in run.manifest.artifacts if e.lane == lane_name and e.validation == "failed"]
    if failed:
        kinds = ", ".join(sorted({e.kind for e in failed}))
        record.status, record.reason = "failed", f"expectations failed for {kinds}; results quarantined"
        return Failed(message=record.reason)
    if failed_gate := next((r for r in verdicts if not r.passed), None):
        record.status, record.reason = "failed", str(GateFailed(failed_gate))
        return Failed(message=record.reason)
    record.status = "passed"
    return Completed(message="passed")
