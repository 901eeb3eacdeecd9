"""The rehearsal lane cut to one short boot with tiny benches: what every fault test injects into."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from tests.conftest import REPO, shipped_inventory, write_inventory


# A decode curve that runs for seconds, not tenths: a fault injected after its first decode record
# lands mid-curve even on a quick idle box (CI once saw the tiny curve end before the kill).
LONG_CURVE = {"repeats": 1, "decode": {"concurrency": [1, 2, 3], "max_tokens": 64, "requests_per_stream": 4,
                                       "prompts": "testbed/prompts/prose.jsonl"}}


def tiny_inventory(folder: Path, port: int, **lane_update) -> Path:
    inv = shipped_inventory()
    lane = inv["lanes"]["rehearsal"]
    lane.pop("correctness", None)
    lane.pop("agentic", None)
    lane["port"] = port
    lane["boot_timeout_s"] = 60
    lane["bench"] = {"repeats": 1, "decode": {"concurrency": [1, 2, 3], "max_tokens": 16, "requests_per_stream": 1,
                                              "prompts": "testbed/prompts/prose.jsonl"}}
    lane.update(lane_update)
    return write_inventory(folder, inv)


class Nightly:
    """`lanebench nightly` (or another flow command) in its own process group (as a terminal starts
    it), with its own PREFECT_HOME."""

    def __init__(self, hosts: Path, artifacts: Path, prefect_home: Path, command: str = "nightly") -> None:
        artifacts.mkdir(parents=True, exist_ok=True)
        self.artifacts = artifacts
        self.log = artifacts.parent / f"{command}-{time.monotonic_ns()}.out"
        self._out = self.log.open("w")
        env = {**os.environ, "PREFECT_HOME": str(prefect_home)}
        env.pop("PREFECT_API_URL", None)
        self.proc = subprocess.Popen([sys.executable, "-m", "flows.cli", command, "--hosts", str(hosts),
                                      "--artifacts", str(artifacts)], cwd=REPO, stdout=self._out,
                                     stderr=subprocess.STDOUT, text=True, start_new_session=True, env=env)
        self.folder: Path | None = None

    def output(self) -> str:
        return self.log.read_text()

    def manifest(self) -> dict:
        return json.loads((self.folder / "manifest.json").read_text()) if self.folder else {}

    def wait_stage(self, stages: tuple[str, ...], timeout: float = 300) -> Path:
        """Wait until the lane is in one of `stages`; returns the run folder."""
        def reached():
            for m in sorted(self.artifacts.glob("*/manifest.json")):
                try:
                    lane = json.loads(m.read_text())["lanes"].get("rehearsal") or {}
                except (OSError, ValueError):
                    continue
                if lane.get("stage") in stages:
                    return m.parent
            assert self.proc.poll() is None, f"nightly ended early:\n{self.output()}"
            return None
        self.folder = wait_for(reached, timeout, f"stage {stages}")
        return self.folder

    def wait(self, timeout: float = 300) -> int:
        rc = self.proc.wait(timeout)
        self._out.close()
        last = self.output().strip().splitlines()[-1]
        if last.startswith("run folder: ") and "(none" not in last:
            self.folder = Path(last.removeprefix("run folder: "))
        return rc

    def signal_group(self, sig: int) -> None:
        os.killpg(self.proc.pid, sig)


def wait_for(predicate, timeout: float, what: str, step: float = 0.2):
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        value = predicate()
        if value:
            return value
        time.sleep(step)
    raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}")


def verify(folder: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "flows.cli", "verify", str(folder)], capture_output=True, text=True,
                          cwd=REPO, timeout=60)


def pidfile_pid(lane: str, port: int) -> int | None:
    from tasks.hosts.transport import local_pidfile

    try:
        return int(local_pidfile(f"{lane}.{port}").read_text().split()[0])
    except (OSError, ValueError):
        return None


def uvicorn_servers_of(prefect_home: Path) -> list[int]:
    """Prefect API servers started with this PREFECT_HOME (read from /proc)."""
    out = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            cmd = (proc / "cmdline").read_bytes()
            env = (proc / "environ").read_bytes()
        except OSError:
            continue
        if b"uvicorn" in cmd and f"PREFECT_HOME={prefect_home}".encode() in env.split(b"\0"):
            out.append(int(proc.name))
    return out


def kill(pid: int, sig: int = signal.SIGKILL) -> None:
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        pass
