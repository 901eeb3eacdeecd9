"""Boot: start the server, wait for health within a deadline, keep the whole boot log.

Boot facts come from the server's log, never from the flags passed: a state-cache cap of 7 hid
behind a bench that asked for 16.
"""

from __future__ import annotations

import re
import time
from pathlib import Path

import httpx
from prefect import task
from prefect.cache_policies import NO_CACHE

from tasks.client import auth
from tasks.client.control import control
from tasks.inventory import api_key
from tasks.inventory.models import Host, Lane
from tasks.engines import engine_for
from tasks.engines.facts import BootFacts
from tasks.hosts import containers
from tasks.hosts.retry import retrying
from tasks.hosts.transport import Spawned, Transport
from tasks.serving import live
from tasks.stages import topology
from tasks.serving.live import Endpoint, Placement, Server

class BootError(RuntimeError):
    pass


class NodeLost(RuntimeError):
    """A worker of a lane across hosts exited while the lane was serving: the lane's reason."""


def _log_tail(path: Path, lines: int = 15) -> str:
    text = path.read_text(errors="replace") if path.exists() else ""
    return "\n".join(text.splitlines()[-lines:])


_ERROR_LINE = re.compile(r"error|couldn't|could not|cannot|can't|failed|unable|abort|fatal", re.IGNORECASE)


def server_words(path: Path) -> str:
    """The server's first error line of its last 8 (else its last line): llama-server says `couldn't bind
    HTTP server socket`, then `exiting due to HTTP server error`."""
    lines = [ln.strip() for ln in _log_tail(path, 200).splitlines() if ln.strip()][-8:]
    said = next((ln for ln in lines if _ERROR_LINE.search(ln)), lines[-1] if lines else "(log empty)")
    return said[:300]


def _exited(server: Server, code: int, port: int) -> BootError:
    """The server exited while booting: its own words, and who holds its port if another does."""
    said = server_words(server.log_path)
    if (other := server.process.listeners(port)) is not None and other.sockets and not server.process.owns(other):
        return BootError(f"impostor on the lane's port: {other.describe()}; the lane's server exited with "
                         f"code {code}: {said!r}. Nothing was sent to it; free port {port} and run again")
    return BootError(f"server exited with code {code} while booting: {said!r}; "
                     f"last log lines:\n{_log_tail(server.log_path)}")


def _listening(server: Server, port: int) -> bool | None:
    """Whether the lane's own server listens on `port` (None: cannot be asked); another process there fails
    the boot before any request reaches it."""
    found = server.process.listeners(port)
    if found is None:
        return None
    if found.sockets == 0 or server.process.owns(found):
        return found.sockets > 0
    end = time.monotonic() + 5.0  # a server that lost the port exits at once: let it say so
    while (code := server.process.poll()) is None and time.monotonic() < end:
        time.sleep(0.2)
    if code is not None:
        raise _exited(server, code, port)
    raise BootError(f"impostor on the lane's port: {found.describe()}; the lane's server (pid "
                    f"{server.process.pid}) does not hold it. Nothing was sent to it; free port {port} and run again")


def process_env(lane: Lane, host: Host, env: dict[str, str] | None) -> dict[str, str]:
    """A host process's environment: on `gpus: 0` the engine's switch that hides the GPUs, the process's
    own env over it (a lane that names CUDA_VISIBLE_DEVICES keeps it)."""
    hidden = engine_for(lane.engine).cpu_only_env() if host.gpus == 0 else {}
    return {**hidden, **(env or {})}


def _spawn(lane: Lane, transport: Transport, host: Host, image: str | None, name: str, argv: list[str],
           env: dict[str, str] | None, log: Path, mounts: list[str]) -> Spawned:
    """One process of the lane, a crashed run's leftover under its name stopped first: in `image` on its host's
    docker, or bare, named by lane and port (a crashed run's server on this port is what would block this boot)."""
    if image is not None:
        containers.remove_leftover(transport, host.docker_host, name)
        return containers.run_container(transport, host.docker_host, name, image, argv[1:], lane.container, host.gpus,
                                        mounts, env or {}, log, entrypoint=argv[0])
    transport.stop_leftover(f"{name}.{lane.port}")
    return transport.spawn(argv, log, name=f"{name}.{lane.port}", env=process_env(lane, host, env))


def start(lane_name: str, lane: Lane, binary: str, address: str, log_path: Path,
          placement: Placement | None = None) -> Server:
    """Start the workers, then the server (a process or the lane's container); a crashed run's leftover
    under the same name is stopped first. Without a placement (scripts, tests): this machine."""
    where = placement or Placement()
    argv, env = where.argv, where.env
    if argv is None:
        head = topology.launches(lane, engine_for(lane.engine), {lane.host: where.host.model_copy(update={"address": address})},
                                 "", topology.Binaries(binary), [])[0]
        argv, env = head.argv, head.env
    key = api_key.resolve(lane, Path.cwd())  # the served lane's api_key_file is absolute (serve.resolved)
    env = {**env, **topology.key_env(engine_for(lane.engine), key)}  # the key in the engine's variable, never argv
    log_path.parent.mkdir(parents=True, exist_ok=True)
    workers: list[Spawned] = []
    mounts = sorted({f"{d}:{d}:ro" for d in {str(Path(f.path).parent) for f in (lane.model, lane.drafter) if f}}
                    | set(lane.container.mounts))
    try:
        for i, worker in enumerate(where.workers):
            name = f"{lane_name}-rpc{i}" if worker.rank is None else f"{lane_name}-node{worker.rank}"
            workers.append(_spawn(lane, worker.transport, worker.host, worker.image, name, worker.argv, worker.env,
                                  log_path.with_name(f"worker-{worker.host_name}.log"), mounts))
        process = _spawn(lane, where.transport, where.host, where.image, lane_name, argv, env, log_path, mounts)
    except BaseException:
        for w in workers:
            w.stop()
        raise
    names = [f"{'rpc-server' if w.rank is None else f'node {w.rank}'} on {w.host_name}" for w in where.workers]
    base_url = f"http://{address}:{lane.port}"
    auth.serve_with(base_url, key)  # every request to it carries the key from now on (tasks/client/auth.py)
    return Server(lane=lane_name, base_url=base_url, argv=argv, log_path=log_path,
                  process=process, engine=lane.engine, workers=workers, image=where.image, worker_names=names)


def wait_healthy(server: Server, lane: Lane, deadline_s: float) -> float:
    """Poll health until 200 or the deadline; connection refused while loading is expected, so retried."""
    engine = engine_for(lane.engine)
    t0 = time.monotonic()

    def probe() -> str | None:
        """None once healthy, else what was seen; a dead server or worker ends the wait."""
        if (code := server.process.poll()) is not None:
            raise _exited(server, code, lane.port)
        if dead := server.dead_workers():  # the group cannot form without every node
            raise BootError(f"{'; '.join(dead)} while the lane was booting")
        if _listening(server, lane.port) is False:  # not listening yet: nothing to ask
            return f"nothing listens on port {lane.port} yet"
        try:
            r = control().get(server.base_url + engine.health_path, timeout=5.0)
        except httpx.TransportError as e:
            return type(e).__name__
        return None if engine.healthy(r.status_code, r.text) else f"HTTP {r.status_code}"

    last = retrying(within_s=deadline_s, wait_s=0.1, growth=1.5, max_wait_s=2.0, until=lambda seen: seen is None)(probe)
    if last is None:
        return time.monotonic() - t0
    raise BootError(f"server not healthy after {deadline_s:.0f} s (last: {last}); "
                    f"last log lines:\n{_log_tail(server.log_path)}")


def stop(server: Server, grace_s: float = 10.0) -> None:
    """Stop the server (its process group, or its container), then its workers."""
    try:
        server.process.stop(grace_s)
    finally:
        auth.forget(server.base_url)
        for worker in server.workers:
            worker.stop(grace_s)


@task(name="boot", cache_policy=NO_CACHE)
def boot(lane_name: str, lane: Lane, binary: str, address: str, log_path: Path) -> tuple[Endpoint, BootFacts, float]:
    """Start the lane's server where its placement says and wait for health; returns its endpoint, boot
    facts and boot seconds."""
    handles = live.handles(lane_name)
    server = start(lane_name, lane, binary, address, log_path, handles.placement)
    try:
        seconds = wait_healthy(server, lane, lane.boot_timeout_s)
    except BaseException:
        stop(server)
        raise
    handles.server = server
    return server.endpoint, read_facts(server.endpoint, lane.engine), seconds


def read_facts(endpoint: Endpoint, engine_name: str, carry: BootFacts | None = None) -> BootFacts:
    """Boot facts from the log, completed from the info endpoint (llama.cpp names the speculation type only
    once a slot has run: read again then). `carry`: an earlier reading whose counter sources are kept."""
    engine = engine_for(engine_name)
    log, info = endpoint.log(), None
    if engine.info_path:
        r = control().get(endpoint.base_url + engine.info_path, timeout=10.0)
        if r.status_code == 200:
            info = r.json()
    # The release decides which log format is read (tasks/engines/releases.py).
    facts = engine.boot_facts(log, engine.version_of(log, info))
    facts = engine.info_facts(facts, info) if info is not None else facts
    for fact, readings in (carry.sources if carry else {}).items():
        if "counters" in readings:
            facts.note(fact, "counters", readings["counters"])
    return facts.reconcile() if carry and any("counters" in r for r in carry.sources.values()) else facts
