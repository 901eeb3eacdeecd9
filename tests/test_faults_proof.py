"""Faults, second pass (issue 27): no impostor server, no laundered records, no hang that passes,
and a history that can prove itself. Real llama-server, real processes; each test asserts the
declared end state and the one line that names the cause. docs/reliability.md lists them.
"""

from __future__ import annotations

import json
import os
import signal
import stat
import sys
import time
from pathlib import Path

import pytest

from tests.conftest import REPO, llama_server_pid
from tests.fault_lane import LONG_CURVE, Nightly, kill, tiny_inventory, verify, wait_for

PORTS = range(18640, 18650)


def _started_by(pid: int, tmp_path: Path) -> bool:
    try:
        env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    except OSError:
        return False
    return any(v.startswith(f"PREFECT_HOME={tmp_path}/".encode()) for v in env)


@pytest.fixture(autouse=True)
def no_leftovers(tmp_path):
    yield
    for port in PORTS:
        if (pid := llama_server_pid(port)) is not None and _started_by(pid, tmp_path):
            kill(pid)
            pytest.fail(f"a llama-server was left on port {port}")


def _wrapper(tmp_path: Path, llama_bin: Path, port: int) -> tuple[Path, Path, Path]:
    """The lane's `binary`: when it is launched as the server, another process (its own session,
    so not the lane's) takes the port first, then the real llama-server starts and cannot bind."""
    seen, ready, pidfile = tmp_path / "impostor-seen", tmp_path / "impostor-ready", tmp_path / "impostor.pid"
    script = tmp_path / "llama-server-raced"
    script.write_text(f"""#!/bin/sh
case " $* " in *" --port {port} "*)
  setsid {sys.executable} {REPO / 'tests' / 'impostor.py'} {port} {seen} {ready} </dev/null >/dev/null 2>&1 &
  echo $! > {pidfile}
  i=0; while [ ! -e {ready} ] && [ $i -lt 200 ]; do sleep 0.05; i=$((i+1)); done;;
esac
exec {llama_bin / 'llama-server'} "$@"
""")
    script.chmod(script.stat().st_mode | stat.S_IXUSR)
    return script, seen, pidfile


def test_an_impostor_on_the_port_fails_the_boot_and_gets_no_request(tmp_path, llama_bin):
    """Another process takes the lane's port between preflight and boot: the lane fails at boot
    naming the holder and quoting llama-server's own line, and not one request reaches the impostor."""
    port = PORTS[0]
    binary, seen, pidfile = _wrapper(tmp_path, llama_bin, port)
    n = Nightly(tiny_inventory(tmp_path, port, binary=str(binary)), tmp_path / "artifacts", tmp_path / "prefect")
    try:
        t0 = time.monotonic()
        rc = n.wait(timeout=180)
        took = time.monotonic() - t0
    finally:
        if pidfile.exists():
            kill(int(pidfile.read_text()))
    out = n.output()
    assert rc == 1, out
    lane = n.manifest()["lanes"]["rehearsal"]
    assert lane["status"] == "failed" and lane["stage"] == "boot", lane
    assert "impostor on the lane's port" in lane["reason"] and "python" in lane["reason"], lane["reason"]
    assert "couldn't bind HTTP server socket" in lane["reason"], lane["reason"]
    assert not seen.exists() or seen.read_text() == "", f"the impostor was sent: {seen.read_text()}"
    assert verify(n.folder).returncode == 0
    print(f"\n[reliability] impostor on the port: ended in {took:.1f} s; reason: {lane['reason'][:160]}")
