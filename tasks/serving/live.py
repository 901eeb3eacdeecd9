"""A served lane's live handles: kept in the process that serves it, found there by lane name.

Prefect tasks take values Prefect can show (tests/test_task_inputs.py): an `Endpoint`, the run
folder's path, a host's name. What cannot be shown stays here: the `Server` with its processes,
its `Placement` and transports, and the lane's `Late` tracker. `served_lane` (tasks/stages/serve.py)
registers a lane once it reached its hosts, boot adds the healthy server, teardown forgets it.
"""

from __future__ import annotations

import shlex
import threading
from collections.abc import Callable
from contextlib import suppress
from dataclasses import dataclass, field
from pathlib import Path

from pydantic import BaseModel, ConfigDict

from tasks.wire.records import RequestRecord
from tasks.hosts.connect import Reach
from tasks.hosts.transport import LocalTransport, Spawned, Transport
from tasks.inventory.models import Host
from tasks.record.run_folder import RunFolder, RunFolderWriteError
from tasks.serving.deadlines import Late, check_alive


class Endpoint(BaseModel):
    """A booted lane's server as a measuring task needs it, in values Prefect can show."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    lane: str
    engine: str
    base_url: str
    log_path: Path

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""


@dataclass
class Worker:
    """A process the lane's server depends on, on another host: an RPC worker, or node `rank` of a multi-node lane."""

    host_name: str
    transport: Transport
    argv: list[str]
    rank: int | None = None
    image: str | None = None
    host: Host = field(default_factory=Host)
    env: dict[str, str] | None = None  # a node's environment (tasks/stages/topology.py node_env); rpc-server: none


@dataclass
class Placement:
    """Where a lane's server runs (default: this machine), its pulled image, the workers to start first."""

    host_name: str = "localhost"
    host: Host = field(default_factory=Host)
    transport: Transport = field(default_factory=LocalTransport)
    image: str | None = None
    workers: list[Worker] = field(default_factory=list)
    argv: list[str] | None = None
    env: dict[str, str] = field(default_factory=dict)


@dataclass
class Server:
    lane: str
    base_url: str
    argv: list[str]
    log_path: Path
    process: Spawned
    engine: str
    workers: list[Spawned] = field(default_factory=list)
    image: str | None = None
    worker_names: list[str] = field(default_factory=list)  # "node 1 on spark2", per entry of `workers`

    def dead_workers(self) -> list[str]:
        """Workers that exited: the reason a lane across hosts stopped serving, in words."""
        return [f"{name} exited with code {code}" for name, w in zip(self.worker_names, self.workers)
                if (code := w.poll()) is not None]

    def log(self) -> str:
        return self.endpoint.log()

    @property
    def command(self) -> str:
        return shlex.join(self.argv)

    @property
    def endpoint(self) -> Endpoint:
        return Endpoint(lane=self.lane, engine=self.engine, base_url=self.base_url, log_path=self.log_path)


@dataclass
class Handles:
    """One served lane's live handles."""

    reach: Reach | None = None
    placement: Placement = field(default_factory=Placement)
    server: Server | None = None  # once healthy
    late: Late = field(default_factory=Late)


_lanes: dict[str, Handles] = {}
_lock = threading.Lock()


def register(name: str, reach: Reach | None = None) -> Handles:
    """The lane is served from here on; two lanes of one name at once in one process are refused."""
    with _lock:
        if name in _lanes:
            raise RuntimeError(f"lane {name} is already served in this process")
        _lanes[name] = handles = Handles(reach)
    return handles


def forget(name: str, handles: Handles) -> None:
    """The lane is no longer served (its teardown); another lane's handles of that name are left alone."""
    with _lock:
        if _lanes.get(name) is handles:
            del _lanes[name]


def served(name: str) -> bool:
    return name in _lanes


def handles(name: str) -> Handles:
    try:
        return _lanes[name]
    except KeyError:
        raise LookupError(f"lane {name} is not served in this process: its live handles are where "
                          "served_lane runs it") from None


def transport(name: str, host_name: str) -> Transport:
    """The open transport to `host_name` that lane `name` reached its hosts with."""
    reach = handles(name).reach
    if reach is None or host_name not in reach.transports:
        raise LookupError(f"lane {name} holds no transport to {host_name}")
    return reach.transports[host_name]


def check(endpoint: Endpoint) -> None:
    """Between waves and after a stage: ServerDied when the server is gone or silent, or a request ran late."""
    if (lane := handles(endpoint.lane)).server is None:
        raise LookupError(f"lane {endpoint.lane} has no healthy server yet")
    check_alive(lane.server, late=lane.late)


def keeper(run_dir: str, endpoint: Endpoint, judged: bool = True) -> Callable[[RequestRecord], None]:
    """`keep` for this lane's records, in the shape a wave hands them over (`on_record`)."""
    return lambda record: keep(run_dir, endpoint, record, judged)


def keep(run_dir: str, endpoint: Endpoint, record: RequestRecord, judged: bool = True) -> None:
    """One raw request record into the lane's `requests.jsonl`, a judged one noted by `Late` first. A
    full disk is not raised here: the lane ends at its next step with that one line (`run.write_error`)."""
    if judged:
        handles(endpoint.lane).late.note(record)
    run = RunFolder.opened(run_dir)
    if run.write_error is not None:
        return
    with suppress(RunFolderWriteError):
        run.append_jsonl(endpoint.lane, "requests.jsonl", record)
