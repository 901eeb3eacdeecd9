"""Boot: start the server, wait for health within a deadline, keep the whole boot log.

The boot facts (running-request cap, context per slot, speculation) come from the log the
server wrote, never from the flags we passed: in the seeds a state-cache cap of 7 hid
behind a bench that asked for 16.
"""

from __future__ import annotations

import atexit
import os
import shlex
import signal
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
from prefect import task
from prefect.cache_policies import NO_CACHE

from tasks.config import Lane
from tasks.engines import engine_for
from tasks.records import BootFacts

_LIVE: dict[int, subprocess.Popen] = {}


@dataclass
class Server:
    lane: str
    base_url: str
    argv: list[str]
    log_path: Path
    process: subprocess.Popen

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    @property
    def command(self) -> str:
        return shlex.join(self.argv)


class BootError(RuntimeError):
    pass


def _log_tail(path: Path, lines: int = 15) -> str:
    text = path.read_text(errors="replace") if path.exists() else ""
    return "\n".join(text.splitlines()[-lines:])


def start(lane_name: str, lane: Lane, binary: str, address: str, log_path: Path) -> Server:
    engine = engine_for(lane.engine)
    argv = engine.launch_command(lane, binary, address)
    log_path.parent.mkdir(parents=True, exist_ok=True)
    log = log_path.open("ab")
    env = {**os.environ, **lane.env}
    # Its own process group, so teardown reaches any children the engine spawns.
    proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                            env=env, start_new_session=True)
    log.close()
    _LIVE[proc.pid] = proc
    return Server(lane=lane_name, base_url=f"http://{address}:{lane.port}", argv=argv, log_path=log_path, process=proc)


def wait_healthy(server: Server, lane: Lane, deadline_s: float) -> float:
    """Poll health until 200 or the deadline; connection refused while loading is expected, so retried."""
    engine = engine_for(lane.engine)
    t0 = time.monotonic()
    delay = 0.1
    last = "no answer yet"
    while time.monotonic() - t0 < deadline_s:
        if server.process.poll() is not None:
            raise BootError(f"server exited with code {server.process.returncode} while booting; "
                            f"last log lines:\n{_log_tail(server.log_path)}")
        try:
            r = httpx.get(server.base_url + engine.health_path, timeout=5.0)
            if engine.healthy(r.status_code, r.text):
                return time.monotonic() - t0
            last = f"HTTP {r.status_code}"
        except httpx.TransportError as e:
            last = type(e).__name__
        time.sleep(delay)
        delay = min(delay * 1.5, 2.0)
    raise BootError(f"server not healthy after {deadline_s:.0f} s (last: {last}); "
                    f"last log lines:\n{_log_tail(server.log_path)}")


def stop(server: Server, grace_s: float = 10.0) -> None:
    """Terminate the server's whole process group; kill it if it does not go in time."""
    proc = server.process
    if proc.poll() is None:
        try:
            os.killpg(proc.pid, signal.SIGTERM)
            proc.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=grace_s)
        except ProcessLookupError:
            pass
    _LIVE.pop(proc.pid, None)


@atexit.register
def _stop_all() -> None:
    """Teardown on every path: a crashed or interrupted run leaves no server behind."""
    for proc in list(_LIVE.values()):
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass


@task(name="boot", cache_policy=NO_CACHE)
def boot(lane_name: str, lane: Lane, binary: str, address: str, log_path: Path) -> tuple[Server, BootFacts, float]:
    """Start the lane's server and wait for health; returns the server, its boot facts and boot seconds."""
    server = start(lane_name, lane, binary, address, log_path)
    try:
        seconds = wait_healthy(server, lane, lane.boot_timeout_s)
    except BaseException:
        stop(server)
        raise
    return server, read_facts(server, lane.engine), seconds


def read_facts(server: Server, engine_name: str) -> BootFacts:
    """Boot facts from the log, completed from the info endpoint. Read again after the first
    requests: some servers (llama.cpp) name the speculation type only once a slot has run."""
    engine = engine_for(engine_name)
    facts = engine.boot_facts(server.log())
    if engine.info_path:
        r = httpx.get(server.base_url + engine.info_path, timeout=10.0)
        if r.status_code == 200:
            facts = engine.info_facts(facts, r.json())
    return facts
