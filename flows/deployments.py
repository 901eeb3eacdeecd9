"""`lanebench serve`: the deployments of prefect.yaml on a real Prefect server, with a process worker.

Without a server, `lanebench nightly` uses Prefect's ephemeral one, which cannot run a
schedule. A nightly needs something that is up at 02:00: `prefect server start`, the
deployments from prefect.yaml (the nightly on its cron, the matrix and the KL gate on demand),
a process work pool and a worker that runs each flow run as a process in this checkout.
`serve` does exactly the documented steps (docs/nightly.md), through Prefect's own CLI, and
stops what it started on Ctrl-C or SIGTERM:

    prefect server start --host H --port P
    prefect work-pool create lanebench --type process
    prefect --no-prompt deploy --prefect-file prefect.yaml -n nightly -n matrix -n kl
    prefect worker start --pool lanebench --type process

A deployment whose entrypoint cannot be loaded yet (its module is missing) is left out with a
message rather than failing the others. Every process runs in its own process group and is
stopped by its group, so no flow run (or the llama-server it started) outlives `serve`.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import yaml

from tasks.engines.build import REPO

PREFECT_FILE = REPO / "prefect.yaml"
POOL = "lanebench"


def prefect_env(api_url: str, home: Path | None = None, extra: dict[str, str] | None = None) -> dict[str, str]:
    """The environment every Prefect process of one stack shares (telemetry off)."""
    env = dict(os.environ, PREFECT_API_URL=api_url, DO_NOT_TRACK="1", PREFECT_SERVER_ANALYTICS_ENABLED="false")
    if home is not None:
        env["PREFECT_HOME"] = str(home)
    return env | (extra or {})


def prefect(*args: str, env: dict[str, str], timeout: float = 180) -> subprocess.CompletedProcess:
    """One `prefect ...` CLI call from this environment, in the repository (entrypoints are relative to it)."""
    return subprocess.run([sys.executable, "-m", "prefect", *args], env=env, cwd=REPO, capture_output=True, text=True,
                          timeout=timeout)


def _spawn(args: list[str], env: dict[str, str], log: Path) -> subprocess.Popen:
    log.parent.mkdir(parents=True, exist_ok=True)
    with log.open("ab") as out:
        return subprocess.Popen([sys.executable, "-m", "prefect", *args], env=env, cwd=REPO, stdout=out,
                                stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True)


def stop(proc: subprocess.Popen | None, grace_s: float = 30) -> None:
    """SIGTERM to the process group, then SIGKILL after `grace_s`: children (flow runs, servers) included."""
    if proc is None or proc.poll() is not None:
        return
    for sig, wait in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 10)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=wait)
            break
        except subprocess.TimeoutExpired:
            continue
    try:  # the group may outlive its leader (a flow run still tearing down)
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def wait_healthy(api_url: str, proc: subprocess.Popen | None, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"prefect server exited with code {proc.returncode} while starting")
        try:
            if httpx.get(f"{api_url}/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise TimeoutError(f"prefect server at {api_url} not healthy after {timeout_s:.0f} s")


@contextmanager
def server(host: str, port: int, home: Path | None, timeout_s: float = 180,
           extra_env: dict[str, str] | None = None) -> Iterator[str]:
    """`prefect server start` on host:port (SQLite under PREFECT_HOME); yields its API URL; stopped on exit."""
    from tasks.hosts.lock import FILE_LEASES, LEASE_STORAGE_ENV

    api_url = f"http://{host}:{port}/api"
    env = prefect_env(api_url, home, extra_env)
    env.pop("PREFECT_API_URL")  # the server serves the API; it is no client of one
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


_CHECK = """
import json, sys
from prefect.flows import load_flow_from_entrypoint
out = {}
for entrypoint in sys.argv[1:]:
    try:
        load_flow_from_entrypoint(entrypoint, use_placeholder_flow=False)
        out[entrypoint] = None
    except BaseException as e:
        out[entrypoint] = f"{type(e).__name__}: {e}".splitlines()[0]
print(json.dumps(out))
"""


def unloadable(entrypoints: list[str]) -> dict[str, str]:
    """Entrypoints whose flow does not load (e.g. its module is not written yet), with why; one process for all."""
    files = {e: e.partition(":")[0] for e in entrypoints}
    why = {e: f"{f} does not exist" for e, f in files.items() if not (REPO / f).is_file()}
    rest = [e for e in entrypoints if e not in why]
    if rest:
        r = subprocess.run([sys.executable, "-c", _CHECK, *rest], cwd=REPO, capture_output=True, text=True, timeout=300)
        if r.returncode != 0:
            raise RuntimeError(f"checking entrypoints failed: {r.stderr[-2000:]}")
        why |= {e: reason for e, reason in json.loads(r.stdout.strip().splitlines()[-1]).items() if reason}
    return why


def deploy(env: dict[str, str], prefect_file: Path = PREFECT_FILE, pool: str = POOL,
           say=print) -> list[str]:
    """Create the process pool if missing and deploy every loadable deployment of `prefect_file`."""
    if prefect("work-pool", "inspect", pool, env=env).returncode != 0:
        r = prefect("work-pool", "create", pool, "--type", "process", env=env)
        if r.returncode != 0:
            raise RuntimeError(f"prefect work-pool create {pool}: {r.stdout}{r.stderr}")
    names = []
    specs = deployments(prefect_file)
    why = unloadable([d["entrypoint"] for d in specs])
    for d in specs:
        if d["entrypoint"] in why:
            say(f"deployment {d['name']} left out: {d['entrypoint']}: {why[d['entrypoint']]}")
        else:
            names.append(d["name"])
    if names:
        args = ["--no-prompt", "deploy", "--prefect-file", str(prefect_file)]
        for name in names:
            args += ["--name", name]
        r = prefect(*args, env=env, timeout=600)
        if r.returncode != 0:
            raise RuntimeError(f"prefect deploy: {r.stdout[-2000:]}{r.stderr[-2000:]}")
    return names


def worker(env: dict[str, str], pool: str, log: Path) -> subprocess.Popen:
    """A process worker on `pool`: each flow run becomes a process in this checkout, with this environment."""
    return _spawn(["worker", "start", "--pool", pool, "--type", "process"], env, log)


def serve(host: str, port: int, home: Path | None, prefect_file: Path, pool: str, api_url: str | None,
          start_worker: bool = True, say=print) -> int:
    """Run the stack until SIGINT/SIGTERM, or until the server or worker dies (exit 1)."""
    stopping = {"signal": None}

    def on_signal(signum: int, _frame: object) -> None:
        stopping["signal"] = signum

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    logs = home or Path(os.environ.get("PREFECT_HOME", Path.home() / ".prefect"))

    def run(url: str) -> int:
        env = prefect_env(url, home)
        names = deploy(env, prefect_file, pool, say)
        say(f"deployed to {url}: {', '.join(names) or '(none)'} on work pool {pool}")
        proc = worker(env, pool, logs / "worker.log") if start_worker else None
        say(f"{'worker running' if proc else 'no worker started'}; logs in {logs}; Ctrl-C stops")
        misses, last_check = 0, time.monotonic()
        try:
            while stopping["signal"] is None:
                if proc is not None and proc.poll() is not None:
                    say(f"worker exited with code {proc.returncode}")
                    return 1
                if time.monotonic() - last_check > 10:
                    last_check = time.monotonic()
                    try:
                        misses = 0 if httpx.get(f"{url}/health", timeout=5).status_code == 200 else misses + 1
                    except httpx.HTTPError:
                        misses += 1
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
    with server(host, port, home) as url:
        say(f"prefect server at {url.removesuffix('/api')}")
        return run(url)
