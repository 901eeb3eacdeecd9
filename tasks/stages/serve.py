"""The served lane: one lifecycle for every flow that needs a lane's server up.

    reach the hosts -> preflight (links, hosts, workers, files, port) -> image pull by digest
    -> boot (workers first) -> boot gates (declared counter and capacity, agentic smoke,
    thinking switch) -> [the caller measures] -> teardown            (on every path)

Every flow serves its lanes through `served_lane`, so a lane behaves the same locally, over SSH, in
a container and across a link. A failed precondition yields `None` with the lane skipped; an image
that cannot be pulled, `None` with the lane failed; a failed boot gate raises `GateFailed` once
recorded. The lane's live handles are registered by name for the block (tasks/serving/live.py).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from tasks.client.prompts import Prompt
from tasks.correctness import record as correctness
from tasks.correctness.smoke import smoke_gate
from tasks.correctness.thinking import thinking_check
from tasks.engines import engine_for
from tasks.engines.facts import BootFacts
from tasks.hosts.containers import container_name
from tasks.hosts.connect import Reach
from tasks.stages.image_pull import image_pull
from tasks.hosts.gpu import cpu_lane_on_gpu, gpu_facts, group_pids, idle_gpu_gate, server_gpu_memory
from tasks.hosts.reclaim import reclaim_leftovers, server_spawn_name
from tasks.hosts.transport import TransportError
from tasks.inventory import secrets
from tasks.inventory.load import shipped_or_local
from tasks.inventory.models import CapacityGate, Host, Inventory, Lane
from tasks.record.run_folder import LaneRecord, RunFolder
from tasks.serving import live
from tasks.stages.boot import NodeLost, boot, read_facts, stop
from tasks.serving.live import Endpoint, Placement, Server, Worker
from tasks.stages.gates import GateFailed, capacity_gate, counter_gate, scrape_metrics
from tasks.record.progress import progress
from tasks.inventory.paths import resolve
from tasks.stages.preflight import Preflight, model_paths, preflight
from tasks.stages.safety import (as_gate, effective_findings, explain, implied_gates, pinned_identity,
                                 speculation_gates)
from tasks.stages import topology


@dataclass
class Served:
    """A lane whose server is up and has passed its boot gates."""

    name: str
    lane: Lane  # as its host serves it: model paths on that host, agentic and RPC flags added
    host: Host
    server: Server
    facts: BootFacts
    record: LaneRecord

    @property
    def endpoint(self) -> Endpoint:
        return self.server.endpoint


def resolved(lane: Lane, host: Host, base_dir: Path, pre: Preflight) -> Lane:
    """The lane as its host serves it: model paths on that host, agentic declarations and RPC workers as flags."""
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
    if lane.api_key_file is not None:  # read on lanebench's machine, relative to the inventory
        update["api_key_file"] = str(resolve(base_dir, lane.api_key_file))
    return lane.model_copy(update={**update, "flags": flags})


def placement(lane: Lane, host: Host, reach: Reach, pre: Preflight, inventory: Inventory | None = None) -> Placement:
    """Where the server and its workers (RPC workers or node ranks) run, through which transports, as
    `topology.launches` builds them."""
    hosts = {**(inventory.hosts if inventory is not None else {}), lane.host: host}
    head, *others = topology.launches(lane, engine_for(lane.engine), hosts, pre.master,
                                      topology.Binaries(pre.binary, pre.node_binaries, pre.rpc_binaries),
                                      pre.rpc_endpoints)
    # An rpc-server starts as on a host of no declared GPUs (its CUDA hidden), as it always has.
    workers = [Worker(w.host_name, reach.transports[w.host_name], w.argv, rank=w.rank, image=lane.image, host=w.host,
                      env=w.env) if w.rank is not None else Worker(w.host_name, reach.transports[w.host_name], w.argv)
               for w in others]
    return Placement(reach.host_name, host, reach.transport, image=lane.image, workers=workers,
                     argv=head.argv, env=head.env)


def boot_gates(run: RunFolder, served: Served, probe: Prompt | None) -> None:
    """Declared and implied gates (tasks/stages/safety.py), declared against effective values, then the
    agentic workload; the first failure raises once every result is recorded."""
    lane, record = served.lane, served.record
    engine = engine_for(lane.engine)
    record.waivers = [w.model_dump(mode="json") for w in lane.waivers]
    before = scrape_metrics(served.endpoint)
    results, probes = [], []
    for gate in implied_gates(lane, engine):
        if isinstance(gate, CapacityGate):
            results.append(capacity_gate(gate, lane, served.facts))
        else:
            if probe is None:
                raise ValueError("a counter gate needs a probe prompt")
            result, sent = counter_gate(gate, served.endpoint, lane, probe, served.facts)
            results.append(result)
            probes.append(sent)
    results += speculation_gates(lane, engine, before, scrape_metrics(served.endpoint), served.server.log(), probes)
    results = [explain(r, lane) for r in results]
    record.gates += results
    # Some servers name their speculation type only once a slot has run: read the facts again.
    served.facts = read_facts(served.endpoint, lane.engine, served.facts)  # the counters' readings kept
    record.boot_facts = served.facts.model_dump(mode="json")
    findings = effective_findings(lane, served.facts, record.models, record.engine_identity, pinned_identity(lane))
    record.flags += findings
    run.save_manifest()
    if failed_gate := next((r for r in results if not r.passed), None) or \
            next((as_gate(f) for f in findings if f.severity == "failure"), None):
        raise GateFailed(failed_gate)
    # The seeds' missing parser flags and ignored thinking switch: checked on the booted server.
    agentic = [*smoke_gate(served.endpoint, lane), *thinking_check(served.endpoint, lane)]
    with run.edit():
        correctness.verdicts(run, served.name).extend(agentic)
    if failed := next((r for r in agentic if not r.passed), None):
        raise GateFailed(failed)


@contextmanager
def served_lane(run: RunFolder, name: str, lane: Lane, host: Host, base_dir: Path,
                inventory: Inventory | None = None, probe: Prompt | None = None, gates: bool = True
                ) -> Iterator[Served | None]:
    """Serve one lane for the body of a `with` block; yields None when it cannot be served. `probe`:
    the prompt a counter gate sends; `gates=False`: no boot gates (the KL gate judges by scores)."""
    record = run.lane(name)
    run.stage(name, "preflight")
    reach = Reach.of(lane.host, lane, host, base_dir, inventory)
    server: Server | None = None
    handles: live.Handles | None = None
    try:
        handles = live.register(name, reach)  # found by name by the stages' tasks, until teardown
        pre, gpu_seen = _preflight(run, name, lane, host, base_dir, inventory, reach)
        if not pre.ok:
            record.status, record.reason = "skipped", pre.reason
            run.save_manifest()
            yield None
            return
        served_as = resolved(lane, host, base_dir, pre)

        if served_as.image is not None:  # container lanes: pulled by digest, verified either way
            run.stage(name, "image pull")
            if not _pulled(run, name, served_as, host, reach, inventory):
                yield None
                return

        run.stage(name, "boot")
        handles.placement = placement(served_as, host, reach, pre, inventory)  # node 0 first, as plan prints it
        _, facts, seconds = boot(name, served_as, pre.binary, host.address, run.lane_dir(name) / "boot.log")
        server = handles.server
        assert server is not None  # a boot that returns has registered its healthy server
        record.launch_command, record.boot_seconds = secrets.scrub(server.command), seconds
        record.boot_facts = facts.model_dump(mode="json")
        if gpu_seen:  # what the booted server holds on the GPU: the offload that happened
            record.gpu.booted = booted = gpu_facts(reach.transport)
            pids = None if server.image else group_pids(reach.transport, server.process.pid) or None
            record.gpu.server_memory_mib = held = server_gpu_memory(booted, pre.binary, pids)
            if host.gpus == 0 and held:
                record.gpu.cpu_lane_holds_gpu = line = cpu_lane_on_gpu(held)
                record.warnings.append(line)
                progress(name, line)
        run.save_manifest()
        served = Served(name, served_as, host, server, facts, record)
        if gates:
            run.stage(name, "boot gates")
            boot_gates(run, served, probe)
        try:
            yield served
        except Exception as e:  # read before teardown stops them: a dead node is the reason, not its echo
            if dead := server.dead_workers():
                raise NodeLost(f"{'; '.join(dead)} (a worker of this lane across hosts is gone)") from e
            raise
    finally:
        _teardown(run, name, lane, reach, handles, server)


def _preflight(run: RunFolder, name: str, lane: Lane, host: Host, base_dir: Path, inventory: Inventory | None,
               reach: Reach) -> tuple[Preflight, bool]:
    """Leftovers reclaimed, preflight run and recorded, free disk and an idle GPU checked; and whether GPU facts are kept."""
    record = run.lane(name)
    for line in reclaim_leftovers(name, lane, host, reach.transports, reach.host_name):
        record.warnings.append(line)
        progress(name, line)
    pre = preflight(name, lane, host, base_dir, inventory)
    if pre.ok and (disk := run.free_space_problem()):
        pre = pre.model_copy(update={"ok": False, "reason": disk})
    record.engine_identity, record.models = pre.engine_identity, list(pre.models)
    record.preflight = pre.model_dump(mode="json", include={"links", "hosts", "rpc_endpoints", "rpc_binaries", "master",
                                               "node_binaries"})
    gpu_seen = False  # a host with nvidia-smi: its GPU facts are recorded whatever it declares
    if pre.ok:
        gpu = gpu_facts(reach.transport)
        gpu_seen = host.gpus > 0 or gpu.ok
        if gpu_seen:
            record.gpu.before = gpu
        if host.gpus > 0 and (busy := idle_gpu_gate(gpu, host.gpus, host.gpu_max_busy_share)):
            pre = pre.model_copy(update={"ok": False, "reason": busy})  # no boot on a GPU others use
    return pre, gpu_seen


def _pulled(run: RunFolder, name: str, served_as: Lane, host: Host, reach: Reach, inventory: Inventory | None) -> bool:
    """The lane's pinned image on every node, pulled by digest; False (the lane failed, recorded) when not."""
    record, image = run.lane(name), served_as.image
    assert image is not None  # called for a lane that runs in a container
    pulled = image_pull(name, reach.host_name, host.docker_host, image)
    for _, node in topology.worker_ranks(served_as):  # every node runs the same pinned image
        if pulled.ok and inventory is not None:
            there = image_pull(name, node, inventory.hosts[node].docker_host, image)
            pulled = pulled if there.ok else there.model_copy(update={"reason": f"{node}: {there.reason}"})
    if not pulled.ok:  # the pinned image cannot be had: nothing to measure, and it must be seen
        record.status, record.reason = "failed", f"image pull: {pulled.reason}"
        run.save_manifest()
        return False
    assert pulled.image is not None  # a pull that is ok names its image
    record.image = pulled.image.model_dump(mode="json")
    run.save_manifest()
    return True


def _teardown(run: RunFolder, name: str, lane: Lane, reach: Reach, handles: live.Handles | None,
              server: Server | None) -> None:
    """Stop the server (or say what is left where), scrub and register its logs, close the transports."""
    record = run.lane(name)
    if handles is not None:
        server = server or handles.server  # healthy, though its boot facts could not be read
        live.forget(name, handles)
    if server is not None:
        run.mark(name, "teardown")
        try:
            stop(server)
        except TransportError as e:  # its host cannot be reached (sshd gone): say what is left where
            what = f"container {container_name(name)}" if server.image else \
                f"pidfile {server_spawn_name(name, lane)}.pid"
            left = (f"teardown: {e}; the server is left on its host ({what}): the next run that reaches "
                    "the host stops it before preflight")
            record.warnings.append(left)
            progress(name, left)
    # A boot that failed left its log too (no server to stop): a refused secret flag is echoed there.
    for log in run.lane_dir(name).glob("*.log"):
        secrets.scrub_file(log)
    if server is not None:
        run.register(name, f"{name}/boot.log", "boot-log")
        for worker in [*(lane.rpc.workers if lane.rpc else []), *(n for _, n in topology.worker_ranks(lane))]:
            if (run.path / name / f"worker-{worker}.log").exists():
                run.register(name, f"{name}/worker-{worker}.log", "boot-log")
    if record.gpu.before is not None:
        record.gpu.after = gpu_facts(reach.transport)
    reach.close()
    if server is not None:
        run.mark(name, "done")
    run.save_manifest()
