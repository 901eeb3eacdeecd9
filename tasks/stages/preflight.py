"""Preflight: everything a lane needs, checked before an expensive boot.

A failed precondition skips the lane with the reason. Cheapest and most telling first (a lane was
lost to an unplugged cable nothing reported): links, host, RPC workers, engine binary, port.
"""

from __future__ import annotations

import shutil
import socket
from pathlib import Path

from prefect import task
from prefect.cache_policies import NO_CACHE
from pydantic import BaseModel

from tasks.engines import engine_for
from tasks.engines.build import BuildError, llama_cpp_bin_dir
from tasks.inventory import api_key
from tasks.inventory.paths import resolve
from tasks.inventory.models import FileRef, Host, Inventory, Lane
from tasks.record.manifest import ModelFacts
from tasks.hosts.files import folder_sha256, sha256_of
from tasks.hosts.checks import HostCheck, check_host, host_path
from tasks.hosts.links import LinkCheck, check_link, lane_links
from tasks.hosts.connect import Reach
from tasks.hosts.transport import Transport, TransportError
from tasks.serving import live
from tasks.stages import topology


class Preflight(BaseModel):
    ok: bool
    reason: str = ""
    binary: str = ""
    engine_identity: dict[str, str] = {}
    models: list[ModelFacts] = []
    links: list[LinkCheck] = []
    hosts: list[HostCheck] = []
    rpc_endpoints: list[str] = []  # "address:port" of each RPC worker, on its end of the link
    rpc_binaries: dict[str, str] = {}  # worker host -> its rpc-server path
    master: str = ""  # a multi-node lane's rendezvous address (the head's end of its link)
    node_binaries: dict[str, str] = {}  # worker node host -> its engine executable (bare lanes)


def _check_file(role: str, ref: FileRef, base_dir: Path) -> ModelFacts | str:
    """A GGUF file, or a Hugging Face folder (its files' bytes and sha256 taken together)."""
    path = resolve(base_dir, ref.path)
    what = "folder" if path.is_dir() else "file"
    if path.is_dir():
        if not (path / "config.json").is_file():
            return f"{role} folder {path} has no config.json: not a Hugging Face model folder"
        size, digest = folder_sha256(path)
    elif path.is_file():
        size, digest = path.stat().st_size, sha256_of(path)
    else:
        return f"{role} file {path} is missing"
    if ref.bytes is not None and size != ref.bytes:
        return f"{role} {what} {path} has {size} bytes, the lane declares {ref.bytes}"
    if ref.sha256 is not None and digest != ref.sha256:
        return f"{role} {what} {path} has sha256 {digest[:12]}..., the lane declares {ref.sha256[:12]}..."
    return ModelFacts(role=role, path=str(path), bytes=size, sha256=digest)


def port_free(address: str, port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        # As servers bind: a port in TIME_WAIT after the previous boot is free to use.
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((address, port))
        except OSError:
            return False
    return True


def _remote_port_free(t: Transport, port: int) -> bool:
    r = t.run(["ss", "-Hltn", f"sport = :{port}"], deadline_s=20, idempotent=True)
    return r.exit_code == 0 and not r.stdout.strip()


def _local_binary(lane: Lane) -> tuple[str, dict[str, str]] | str:
    """The lane's `binary`, or the engine's own local build; one that cannot be had is the lane's skip reason."""
    if lane.binary is None:
        try:
            return engine_for(lane.engine).local_build()
        except BuildError as e:
            return str(e)
    found = shutil.which(lane.binary)
    if not found:
        return f"engine binary {lane.binary!r} not found"
    return found, {"path": found, "sha256": sha256_of(found)}


def _remote_binary(t: Transport, host_name: str, path: str) -> tuple[str, dict[str, str]] | str:
    """An engine executable on another host (the lane's `binary`, else the pinned build's path there)."""
    r = t.run(["sha256sum", "--", path], deadline_s=60, idempotent=True)
    if r.exit_code != 0 or not r.stdout.strip():
        return f"engine binary {path} is missing on {host_name} (set the lane's 'binary' to its path there)"
    return path, {"path": path, "sha256": r.stdout.split()[0], "host": host_name}


def _pinned(name: str) -> str | None:
    try:
        return str(llama_cpp_bin_dir() / name)
    except BuildError:
        return None


def _remote(lane: Lane, host: Host, base_dir: Path, inventory: Inventory | None, reach: Reach,
            pre: Preflight) -> str | None:
    """The checks through the lane's transports, recorded in `pre` as they pass; the first failure's reason."""
    if lane_links(lane) and inventory is None:
        return "lane needs links but was run without its inventory"
    links = {lk.name: lk for lk in inventory.links} if inventory is not None else {}
    for name in lane_links(lane):
        pre.links.append(check := check_link(links[name], reach.transports))
        if not check.ok:
            return check.reason
    files = [f for f in (lane.model, lane.drafter) if f is not None]
    main = check_host(reach.host_name, host, reach.transport, files, needs_docker=lane.image is not None,
                      base_dir=base_dir)
    pre.hosts.append(main)
    if not main.ok:
        return main.reason
    roles = ["model", "drafter"] if lane.drafter is not None else ["model"]
    pre.models = [ModelFacts(role=r, path=f.path, bytes=f.bytes, sha256=f.sha256) for r, f in zip(roles, main.files)]
    if lane.rpc is not None:
        link = links[lane.rpc.link]
        worker_binary = lane.rpc.binary or _pinned("rpc-server") or "rpc-server"
        for worker in lane.rpc.workers:
            if (end := link.end(worker)) is None:
                return f"RPC worker {worker} is not an end of link {link.name}"
            wcheck = check_host(worker, inventory.hosts[worker], reach.transports[worker], [], needs_docker=False,  # type: ignore[union-attr]
                                base_dir=base_dir)
            pre.hosts.append(wcheck)
            if not wcheck.ok:
                return f"RPC worker {wcheck.reason}"
            if isinstance(found := _remote_binary(reach.transports[worker], worker, worker_binary), str):
                return f"RPC worker: {found}"
            pre.engine_identity[f"rpc_worker_{worker}"] = found[1]["sha256"]
            pre.rpc_binaries[worker] = found[0]
            pre.rpc_endpoints.append(f"{end.address}:{lane.rpc.port}")
    if topology.spans_nodes(lane) and (failed := _check_nodes(lane, base_dir, inventory, reach, pre)):  # type: ignore[arg-type]
        return failed
    if lane.image is not None:
        pre.binary, pre.engine_identity = lane.container.entrypoint_binary, {**pre.engine_identity, "image": lane.image}
    else:
        engine = engine_for(lane.engine)
        path = lane.binary or (_pinned(engine.local_binary_name) if engine.pinned_build and engine.local_binary_name else None)
        if path is None:
            return f"lane declares no binary for engine {lane.engine} (set 'binary', or run it from a pinned 'image')"
        found = _remote_binary(reach.transport, reach.host_name, path) if host.transport != "local" else _local_binary(lane)
        if isinstance(found, str):
            return found
        pre.binary, identity = found
        pre.engine_identity = {**identity, **pre.engine_identity}
    free = port_free(host.address, lane.port) if host.transport == "local" else _remote_port_free(reach.transport, lane.port)
    return None if free else f"port {lane.port} on {reach.host_name} ({host.address}) is already in use"


def _check_nodes(lane: Lane, base_dir: Path, inventory: Inventory, reach: Reach, pre: Preflight) -> str | None:
    """Every worker node: reachable, docker or the engine binary, the model files at their path there."""
    pre.master = topology.master_address(lane, inventory)
    files = [f for f in (lane.model, lane.drafter) if f is not None]
    for _, name in topology.worker_ranks(lane):
        check = check_host(name, inventory.hosts[name], reach.transports[name], files,
                           needs_docker=lane.image is not None, base_dir=base_dir)
        pre.hosts.append(check)
        if not check.ok:
            return f"node {check.reason}"
        if lane.image is None:
            if lane.binary is None:
                return f"lane declares no binary for engine {lane.engine} (set 'binary', or run it from a pinned 'image')"
            found = _remote_binary(reach.transports[name], name, lane.binary)
            if isinstance(found, str):
                return f"node: {found}"
            pre.node_binaries[name] = found[0]
            pre.engine_identity[f"node_{name}"] = found[1]["sha256"]
    return None


def _needs_reach(lane: Lane, host: Host) -> bool:
    return (host.transport != "local" or lane.image is not None or lane.rpc is not None or bool(lane.links)
            or lane.nodes is not None)


@task(name="preflight", cache_policy=NO_CACHE)
def preflight(lane_name: str, lane: Lane, host: Host, base_dir: Path, inventory: Inventory | None = None) -> Preflight:
    """Links, host, workers, binary, model files with declared bytes (and sha256), port free; remote checks
    through the served lane's transports."""
    try:
        api_key.resolve(lane, base_dir)  # its value stays here: Preflight is a task result
    except api_key.KeyUnavailable as e:
        return Preflight(ok=False, reason=str(e))
    pre = Preflight(ok=False)
    if not _needs_reach(lane, host):
        reason = _local(lane, host, base_dir, pre)
    elif (reach := live.handles(lane_name).reach if live.served(lane_name) else None) is None:
        reason = "a remote, container or RPC lane needs its hosts' transports"
    else:
        try:
            reason = _remote(lane, host, base_dir, inventory, reach, pre)
        except TransportError as e:
            return Preflight(ok=False, reason=f"preflight: {e}")
    pre.ok, pre.reason = reason is None, reason or ""
    return pre


def _local(lane: Lane, host: Host, base_dir: Path, pre: Preflight) -> str | None:
    """The checks on this machine, recorded in `pre` as they pass; the first failure's reason."""
    if isinstance(found := _local_binary(lane), str):
        return found
    pre.binary, pre.engine_identity = found
    models = []
    for role, ref in (("model", lane.model), ("drafter", lane.drafter)):
        if ref is None:
            continue
        if isinstance(facts := _check_file(role, ref, base_dir), str):
            return facts
        models.append(facts)
    pre.models = models
    return None if port_free(host.address, lane.port) else f"port {lane.port} on {host.address} is already in use"


def model_paths(lane: Lane, host: Host, base_dir: Path) -> dict[str, str]:
    """Where the lane's model files are on its host (what the server is told to load)."""
    return {role: host_path(host, ref.path, base_dir) if host.transport != "local" else str(resolve(base_dir, ref.path))
            for role, ref in (("model", lane.model), ("drafter", lane.drafter)) if ref is not None}

