"""The lane flow: one serving configuration, from preflight to validated results.

    preflight (links, host, workers, files, port) -> image pull by digest -> boot
              -> boot gates (declared, agentic smoke, thinking switch) -> warmup
              -> decode curve -> acceptance probe -> tool gate -> needle ladder
              -> expectations -> artifacts            (teardown on every path)

Read it as the recipe the seeds did by hand. A failed precondition skips the lane with its
reason; a failed boot gate stops the lane's measurements and names gate, value and threshold;
a failed correctness gate (tool gate, needle ladder) fails the lane after its tables are kept;
a table that fails its expectations is quarantined and fails the lane.

`stages="tools"` (used by `lanebench tools`) boots, runs the boot gates and the tool gate
only; `held_out=True` adds the held-out tool suite. Matrix arms skip the tool gate and the
needle ladder (`SPEED_ONLY_FLOWS`).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Literal

from prefect import flow, get_run_logger
from prefect.states import Completed, Failed, State

from tasks.correctness import record as correctness
from tasks.stages.acceptance import acceptance_probe
from tasks.record.run_folder import LaneRecord, RunFolder
from tasks.stages.boot import Placement, Server, Worker, boot, read_facts, stop
from tasks.inventory.models import CapacityGate, Host, Inventory, Lane
from tasks.inventory.load import shipped_or_local
from tasks.hosts.containers import image_pull
from tasks.stages.decode_curve import decode_curve
from tasks.engines import engine_for
from tasks.stages.gates import GateFailed, capacity_gate, counter_gate
from tasks.correctness.needles import needle_ladder
from tasks.stages.preflight import Preflight, Reach, model_paths, preflight, resolve
from tasks.record.progress import progress
from tasks.client.prompts import Prompt, load_prompts
from tasks.record.rows import GateResult
from tasks.correctness.smoke import smoke_gate
from tasks.correctness.thinking import thinking_check
from tasks.correctness.tool_gate import tool_gate
from tasks.stages.warmup import warmup
from tasks.stages import topology


# Flows whose lanes are speed measurements of one target under many arms (drafter x K): the
# target's tool gate and needle ladder are the nightly's and `lanebench tools`' business, and
# would cost every arm a minute. The agentic boot gates still run (they are seconds).
SPEED_ONLY_FLOWS = frozenset({"matrix"})


def _resolved(lane: Lane, host: Host, base_dir: Path, pre: Preflight) -> Lane:
    """The lane as its host serves it: model paths where they are on that host, its agentic
    declarations (tools, reasoning, chat template) and its RPC workers turned into the engine's
    launch flags."""
    engine = engine_for(lane.engine)
    paths = model_paths(lane, host, base_dir)
    update: dict = {"model": lane.model.model_copy(update={"path": paths["model"]})}
    if lane.drafter is not None:
        update["drafter"] = lane.drafter.model_copy(update={"path": paths["drafter"]})
    flags = list(lane.flags)
    if lane.agentic is not None:
        template = lane.agentic.chat_template
        path = str(shipped_or_local(base_dir, template)) if template is not None else None
        flags = engine.agentic_flags(lane.agentic, path) + flags
    if pre.rpc_endpoints:
        flags = engine.rpc_flags(pre.rpc_endpoints) + flags
    return lane.model_copy(update={**update, "flags": flags})


def _placement(lane: Lane, host: Host, reach: Reach, pre: Preflight, inventory: Inventory | None = None) -> Placement:
    engine = engine_for(lane.engine)
    workers = []
    for rank, name in topology.worker_ranks(lane):  # vLLM/SGLang worker nodes (tasks/stages/topology.py)
        node = inventory.hosts[name] if inventory is not None else Host()
        binary = lane.container.entrypoint_binary if lane.image else pre.node_binaries[name]
        argv = engine.launch_command(topology.at_rank(lane, engine, rank, pre.master), binary, node.address)
        workers.append(Worker(name, reach.transports[name], argv, rank=rank, image=lane.image, host=node))
    for worker, endpoint in zip(lane.rpc.workers if lane.rpc else [], pre.rpc_endpoints):
        address, port = endpoint.rsplit(":", 1)
        binary = pre.rpc_binaries[worker]
        workers.append(Worker(worker, reach.transports[worker],
                              engine.rpc_worker_command(binary, address, int(port), lane.threads)))
    return Placement(reach.host_name, host, reach.transport, image=lane.image, workers=workers)


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
    record.config = lane.model_dump(mode="json")

    server: Server | None = None

    def stage(name: str) -> None:
        if server is not None and server.dead_workers():  # a lane across hosts lost a node: stop measuring
            raise RuntimeError(f"a worker died before {name}")
        record.stage = name
        run.save_manifest()
        progress(lane_name, name)

    def keep(rec) -> None:
        run.append_jsonl(lane_name, "requests.jsonl", rec)

    # 1. Preflight: links, host, workers, binary, model files with declared bytes, port free.
    stage("preflight")
    reach = Reach.of(lane.host, lane, host, base_dir, inventory)
    pre = preflight(lane_name, lane, host, base_dir, inventory, reach)
    record.engine_identity, record.models = pre.engine_identity, [m.model_dump() for m in pre.models]
    record.preflight = pre.model_dump(include={"links", "hosts", "rpc_endpoints", "rpc_binaries", "master",
                                               "node_binaries"})
    if not pre.ok:
        reach.close()
        record.status, record.reason = "skipped", pre.reason
        run.save_manifest()
        logger.warning("lane %s skipped: %s", lane_name, pre.reason)
        return Completed(name="Skipped", message=pre.reason)

    lane = _resolved(lane, host, base_dir, pre)
    decode_prompts, class_prompts = _prompt_sets(lane, base_dir)
    server = None
    try:
        # 2. Image pull by digest (container lanes): skipped when the host has it, verified either way.
        if lane.image is not None:
            stage("image pull")
            pulled = image_pull(reach.transport, host.docker_host, lane.image)
            for _, name in topology.worker_ranks(lane):  # every node runs the same pinned image
                if pulled.ok and inventory is not None:
                    node_pull = image_pull(reach.transports[name], inventory.hosts[name].docker_host, lane.image)
                    pulled = pulled if node_pull.ok else node_pull.model_copy(update={"reason": f"{name}: {node_pull.reason}"})
            if not pulled.ok:  # the pinned image cannot be had: nothing to measure, and it must be seen
                record.status, record.reason = "failed", f"image pull: {pulled.reason}"
                return Failed(message=record.reason)
            record.image = pulled.image.model_dump()
            run.save_manifest()

        # 3. Boot: start (workers first), wait for health, keep the whole log, read what the server resolved.
        stage("boot")
        server, facts, seconds = boot(lane_name, topology.at_rank(lane, engine_for(lane.engine), 0, pre.master),
                                      pre.binary, host.address, run.lane_dir(lane_name) / "boot.log",
                                      _placement(lane, host, reach, pre, inventory))
        record.launch_command, record.boot_seconds = server.command, seconds
        record.boot_facts = facts.model_dump()
        run.save_manifest()

        # 4. Boot gates, declared per lane: any failure stops this lane's measurements.
        stage("boot gates")
        probe = min([*decode_prompts, *(p for ps in class_prompts.values() for p in ps)], key=lambda p: len(p.text))
        for gate in lane.gates:
            if isinstance(gate, CapacityGate):
                result = capacity_gate(gate, lane, facts)
            else:
                result = counter_gate(gate, server, lane_name, lane, probe, facts)
            record.gates.append(result.model_dump())
            run.save_manifest()
            if not result.passed:
                raise GateFailed(result)
        # Some servers name their speculation type only once a slot has run: read the facts again.
        record.boot_facts = read_facts(server, lane.engine, facts).model_dump()
        run.save_manifest()
        # The workload the lane declares it serves: structured tool calls, reasoning apart from
        # the content (the seeds' missing parser flags), and every declared thinking switch.
        # Recorded with the correctness verdicts (manifest flow.correctness.<lane>.gates).
        agentic = [*smoke_gate(server, lane), *thinking_check(server, lane)]
        correctness.verdicts(run, lane_name).extend(r.model_dump() for r in agentic)
        run.save_manifest()
        if failed_gate := next((r for r in agentic if not r.passed), None):
            raise GateFailed(failed_gate)

        if stages == "tools":
            return _correctness(run, record, lane_name, lane, host, base_dir, server, stage, held_out,
                                needles=False)

        # 5. Warmup: every batch shape a bench will use, first hit recorded apart.
        stage("warmup")
        shapes = [(c, "decode", lane.bench.decode.max_tokens) for c in lane.bench.decode.concurrency]
        if lane.bench.acceptance is not None:
            shapes += [(1, c, lane.bench.acceptance.max_tokens) for c in class_prompts]
        warm = warmup(server, lane_name, lane.engine, shapes, {"decode": decode_prompts, **class_prompts}, keep)
        run.write_table(lane_name, "warmup", warm)

        # 6. Decode curve: repeats at each concurrency level, median and spread.
        stage("decode curve")
        rows = decode_curve(server, lane_name, lane.engine, lane.bench.decode, lane.bench.repeats, decode_prompts,
                            keep, on_progress=lambda s: progress(lane_name, s))
        run.write_table(lane_name, "decode", rows)

        # 7. Acceptance probe: per prompt class, counter deltas over the probe window only.
        if lane.speculative is not None and lane.bench.acceptance is not None:
            stage("acceptance probe")
            acc_rows, silent = acceptance_probe(server, lane_name, lane.engine, lane.speculative.k, class_prompts,
                                                lane.bench.acceptance.max_tokens, lane.bench.repeats, keep,
                                                on_progress=lambda s: progress(lane_name, s))
            for prompt_class in silent:
                record.warnings.append(f"acceptance probe: class {prompt_class} had no verification step")
            if acc_rows:
                run.write_table(lane_name, "acceptance", acc_rows)

        # 8-9. Correctness on the same booted server: tool-call gate, needle ladder; then
        # expectations on the raw records too. Any failed suite or gate fails the lane.
        if run.manifest.flow.get("name") in SPEED_ONLY_FLOWS:
            return _correctness(run, record, lane_name, lane.model_copy(update={"correctness": None}), host,
                                base_dir, server, stage, held_out, needles=False)
        return _correctness(run, record, lane_name, lane, host, base_dir, server, stage, held_out, needles=True)
    except GateFailed as e:
        record.status, record.reason = "failed", str(e)
        return Failed(message=str(e))
    except Exception as e:  # a crashed stage fails this lane, not the run
        record.status, record.reason = "failed", f"{record.stage}: {type(e).__name__}: {e}"
        if server is not None and (dead := server.dead_workers()):  # a node of the group died: that is the reason
            record.reason = f"{record.stage}: {'; '.join(dead)} (a worker of this lane across hosts is gone)"
        logger.exception("lane %s failed in %s", lane_name, record.stage)
        return Failed(message=record.reason)
    finally:
        # Teardown on every path: success, failure, cancellation.
        if server is not None:
            stop(server)
            run.register(lane_name, f"{lane_name}/boot.log", "boot-log")
            for worker in [*(lane.rpc.workers if lane.rpc else []), *(n for _, n in topology.worker_ranks(lane))]:
                run.register(lane_name, f"{lane_name}/worker-{worker}.log", "boot-log")
        reach.close()
        try:
            correctness.write(run, lane_name)
        except Exception as e:  # a view of the verdicts and tables; losing it must not lose the lane
            record.warnings.append(f"correctness.md: {type(e).__name__}: {e}")
        run.save_manifest()


def _correctness(run: RunFolder, record: LaneRecord, lane_name: str, lane: Lane, host: Host, base_dir: Path,
                 server: Server, stage: Callable[[str], None], held_out: bool, needles: bool) -> State:
    """Tool gate and needle ladder (their tables kept whatever the verdict), then expectations."""
    verdicts: list[GateResult] = []
    if lane.correctness is not None and lane.correctness.tool_gate is not None:
        stage("tool gate")
        verdicts += tool_gate(server, run, lane_name, lane, host, base_dir, held_out)
    if needles and lane.correctness is not None and lane.correctness.needles is not None:
        stage("needle ladder")
        ladder = needle_ladder(server, run, lane_name, lane)
        verdicts += [ladder] if ladder is not None else []
    correctness.verdicts(run, lane_name).extend(r.model_dump() for r in verdicts)
    run.save_manifest()

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
