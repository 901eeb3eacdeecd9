"""`lanebench serve`: the deployments of prefect.yaml on a real Prefect server, with a process worker.

The ephemeral server cannot run a schedule, so a nightly needs `prefect server start`, the
deployments of prefect.yaml, a process work pool and a worker (docs/nightly.md). The two daemons
are Prefect's own commands, each in its own process group (stopped by its group, so no flow run
or llama-server outlives `serve`); pool and deployments go through Prefect's Python API, so there
is no CLI output to parse. A deployment whose entrypoint cannot be loaded is left out with a message.

`--database`: a team's server writes from many connections at once, where SQLite answers 503
"database is locked" and PostgreSQL does not; users write `postgresql://`, `connection_url`
adds the async driver Prefect needs.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from pathlib import Path
from typing import TYPE_CHECKING, cast
from urllib.parse import urlsplit

import httpx
import yaml

from tasks.hosts.retry import retrying
from tasks.inventory.paths import REPO

if TYPE_CHECKING:
    from prefect.flows import Flow

PREFECT_FILE = REPO / "prefect.yaml"
POOL = "lanebench"
_DRIVERS = {"postgresql": "postgresql+asyncpg", "postgres": "postgresql+asyncpg",
            "postgresql+asyncpg": "postgresql+asyncpg", "sqlite": "sqlite+aiosqlite",
            "sqlite+aiosqlite": "sqlite+aiosqlite"}


class DatabaseUrlError(ValueError):
    """A --database value Prefect cannot use; the message names the fix."""


def connection_url(url: str) -> str:
    """`postgresql://user[:pw]@host[:port]/db` -> Prefect's `postgresql+asyncpg://...` (sqlite likewise)."""
    parts = urlsplit(url)
    driver = _DRIVERS.get(parts.scheme)
    shown = url if parts.password is None else url.replace(f":{parts.password}@", ":***@", 1)
    if driver is None:
        raise DatabaseUrlError(f"--database {shown}: scheme {parts.scheme or '(none)'!r} is not supported. "
                               "Fix: postgresql://USER[:PASSWORD]@HOST[:PORT]/DATABASE or sqlite:////abs/path.db")
    if driver.startswith("postgresql") and (not parts.hostname or not parts.path.strip("/")):
        raise DatabaseUrlError(f"--database {shown}: needs a host and a database name. "
                               "Fix: postgresql://USER[:PASSWORD]@HOST[:PORT]/DATABASE")
    if driver.startswith("sqlite") and not parts.path.strip("/"):
        raise DatabaseUrlError(f"--database {url}: needs a file path. Fix: sqlite:////abs/path/prefect.db")
    return driver + url[len(parts.scheme):]


def prefect_env(api_url: str, home: Path | None = None, extra: dict[str, str] | None = None) -> dict[str, str]:
    """The environment every Prefect process of one stack shares (telemetry off)."""
    env = dict(os.environ, PREFECT_API_URL=api_url, DO_NOT_TRACK="1", PREFECT_SERVER_ANALYTICS_ENABLED="false")
    if home is not None:
        env["PREFECT_HOME"] = str(home)
    return env | (extra or {})


def _spawn(args: list[str], env: dict[str, str], log: Path) -> subprocess.Popen:
    log.parent.mkdir(parents=True, exist_ok=True)
    with log.open("ab") as out:
        return subprocess.Popen([sys.executable, "-m", "prefect", *args], env=env, cwd=REPO, stdout=out,
                                stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True)


def stop(proc: subprocess.Popen | None, grace_s: float = 30) -> None:
    """SIGTERM to the process group, then SIGKILL after `grace_s`: children (flow runs, servers) included."""
    if proc is None or proc.poll() is not None:
        return
    try:
        os.killpg(proc.pid, signal.SIGTERM)
    except ProcessLookupError:
        return
    with suppress(subprocess.TimeoutExpired):
        proc.wait(timeout=grace_s)
    with suppress(ProcessLookupError, PermissionError):  # the group may outlive its leader (a flow run tearing down)
        os.killpg(proc.pid, signal.SIGKILL)
    with suppress(subprocess.TimeoutExpired):
        proc.wait(timeout=10)


def _healthy(api_url: str, timeout_s: float = 2) -> bool:
    try:
        return httpx.get(f"{api_url}/health", timeout=timeout_s).status_code == 200
    except httpx.HTTPError:
        return False


def wait_healthy(api_url: str, proc: subprocess.Popen | None, timeout_s: float, poll_s: float = 0.5) -> None:
    """Until `api_url/health` answers 200; raises when `proc` exits first or `timeout_s` passes."""
    def healthy() -> bool:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"prefect server exited with code {proc.returncode} while starting")
        return _healthy(api_url)

    if not retrying(within_s=timeout_s, wait_s=poll_s, until=bool)(healthy):
        raise TimeoutError(f"prefect server at {api_url} not healthy after {timeout_s:.0f} s")


@contextmanager
def server(host: str, port: int, home: Path | None, timeout_s: float = 180,
           extra_env: dict[str, str] | None = None, database: str | None = None) -> Iterator[str]:
    """`prefect server start` on host:port (SQLite under PREFECT_HOME, or `database`); yields its API URL."""
    from tasks.hosts.lock import FILE_LEASES, LEASE_STORAGE_ENV

    api_url = f"http://{host}:{port}/api"
    db = {"PREFECT_API_DATABASE_CONNECTION_URL": connection_url(database)} if database else {}
    env = prefect_env(api_url, home, (extra_env or {}) | db)
    env.pop("PREFECT_API_URL")  # the server serves the API; it is no client of one
    # The UI's calls go here (Prefect's default is port 4200 whatever --port says); a server on
    # 0.0.0.0 is reached by its name: set PREFECT_UI_API_URL to it.
    env.setdefault("PREFECT_UI_API_URL", api_url)
    # Leases on disk: a restarted server still knows who holds a host (tasks/host_lock.py).
    env.setdefault(LEASE_STORAGE_ENV, FILE_LEASES)
    log = (home or Path(env.get("PREFECT_HOME", Path.home() / ".prefect"))) / "server.log"
    proc = _spawn(["server", "start", "--host", host, "--port", str(port)], env, log)
    try:
        wait_healthy(api_url, proc, timeout_s)
        yield api_url
    finally:
        stop(proc)


def deployments(prefect_file: Path) -> list[dict]:
    return list((yaml.safe_load(prefect_file.read_text()) or {}).get("deployments") or [])


def _loaded(entrypoint: str) -> tuple[Flow | None, str]:
    """The flow behind an entrypoint, or why it cannot be loaded."""
    from prefect.flows import load_flow_from_entrypoint

    if not (REPO / entrypoint.partition(":")[0]).is_file():
        return None, f"{entrypoint.partition(':')[0]} does not exist"
    try:
        return load_flow_from_entrypoint(str(REPO / entrypoint), use_placeholder_flow=False), ""
    except Exception as e:
        return None, f"{type(e).__name__}: {e}".splitlines()[0]


def _schedules(spec: dict) -> list:
    """prefect.yaml's cron schedules as Prefect schedule objects."""
    from prefect.schedules import Cron

    if bad := [s for s in spec.get("schedules") or [] if "cron" not in s]:
        raise ValueError(f"deployment {spec['name']}: only cron schedules are supported, got {bad[0]}")
    return [Cron(s["cron"], timezone=s.get("timezone", "UTC"), active=s.get("active", True))
            for s in spec.get("schedules") or []]


def ensure_pool(env: dict[str, str], pool: str = POOL, queues: list[str] | None = None) -> None:
    """The process work pool and its `queues` (a site's or host group's) on the server `env` names, created when missing."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.actions import WorkPoolCreate
    from prefect.exceptions import ObjectAlreadyExists
    from prefect.settings import PREFECT_API_URL, temporary_settings

    with temporary_settings({PREFECT_API_URL: env["PREFECT_API_URL"]}):
        with get_client(sync_client=True) as client:
            with suppress(ObjectAlreadyExists):
                client.create_work_pool(WorkPoolCreate(name=pool, type="process"))
            for queue in queues or []:
                with suppress(ObjectAlreadyExists):
                    client.create_work_queue(name=queue, work_pool_name=pool)


def deploy(env: dict[str, str], prefect_file: Path = PREFECT_FILE, pool: str = POOL,
           say=print, queues: list[str] | None = None) -> list[str]:
    """The pool (ensure_pool), then every loadable deployment of `prefect_file`, on the server `env` names."""
    from prefect.settings import PREFECT_API_URL, temporary_settings

    names = []
    ensure_pool(env, pool, queues)
    with temporary_settings({PREFECT_API_URL: env["PREFECT_API_URL"]}):
        for spec in deployments(prefect_file):
            flow, why = _loaded(spec["entrypoint"])
            if flow is None:
                say(f"deployment {spec['name']} left out: {spec['entrypoint']}: {why}")
                continue
            # The code is this checkout: each flow run's working folder is the repository (called sync).
            sourced = cast("Flow", flow.from_source(source=str(REPO), entrypoint=spec["entrypoint"]))
            work_pool = spec.get("work_pool") or {}
            sourced.deploy(name=spec["name"], work_pool_name=work_pool.get("name", pool),
                           work_queue_name=work_pool.get("work_queue_name"), parameters=spec.get("parameters") or {},
                           description=spec.get("description"), schedules=_schedules(spec),
                           build=False, push=False, print_next_steps=False)
            names.append(spec["name"])
    return names


def worker_args(pool: str, queues: list[str] | None = None, name: str | None = None) -> list[str]:
    """`prefect worker start` on `pool` (only `queues` of it, when given): each flow run a process in this checkout."""
    return ["worker", "start", "--pool", pool, "--type", "process", *[a for q in queues or [] for a in ("--work-queue", q)],
            *(["--name", name] if name else [])]


def serve(host: str, port: int, home: Path | None, prefect_file: Path, pool: str, api_url: str | None,
          start_worker: bool = True, say=print, database: str | None = None, queues: list[str] | None = None) -> int:
    """Run the stack until SIGINT/SIGTERM, or until the server or worker dies (exit 1)."""
    # A list the handler appends to, not a threading.Event: the handler runs in the main thread,
    # which may be inside Event.wait() holding the event's lock, and Event.set() would wait on it forever.
    stopping: list[int] = []
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda signum, _frame: stopping.append(signum))
    logs = home or Path(os.environ.get("PREFECT_HOME", Path.home() / ".prefect"))

    def run(url: str) -> int:
        env = prefect_env(url, home)
        names = deploy(env, prefect_file, pool, say, queues)
        say(f"deployed to {url}: {', '.join(names) or '(none)'} on work pool {pool}")
        proc = _spawn(worker_args(pool, queues), env, logs / "worker.log") if start_worker else None
        say(f"{'worker running' if proc else 'no worker started'}; logs in {logs}; Ctrl-C stops")
        misses, last_check = 0, time.monotonic()
        try:
            while not stopping:
                if proc is not None and proc.poll() is not None:
                    say(f"worker exited with code {proc.returncode}")
                    return 1
                if time.monotonic() - last_check > 10:
                    last_check = time.monotonic()
                    misses = 0 if _healthy(url, 5) else misses + 1
                    if misses >= 3:
                        say(f"prefect server at {url} stopped answering")
                        return 1
                time.sleep(0.5)
        finally:
            stop(proc)
        return 0

    if api_url:
        wait_healthy(api_url, None, 30)
        return run(api_url)
    with server(host, port, home, database=database) as url:
        say(f"prefect server at {url.removesuffix('/api')}")
        return run(url)
