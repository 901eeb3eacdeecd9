"""Shared fixtures: real components only (the pinned llama-server, Prefect's own test server)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parent.parent


@contextmanager
def fake_server(port: int, *args: str) -> Iterator[str]:
    """benchmarks/fake_server.py on `port` with `args`, up until the block ends; yields its base URL."""
    proc = subprocess.Popen([sys.executable, str(REPO / "benchmarks/fake_server.py"), "--port", str(port), *args],
                            stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None and "listening" in proc.stdout.readline()
        yield f"http://127.0.0.1:{port}"
    finally:
        proc.terminate()
        proc.wait(10)
os.environ.setdefault("DO_NOT_TRACK", "1")


@pytest.fixture(scope="session")
def llama_bin() -> Path:
    """The pinned llama.cpp build (built on first use, cached in ~/.cache/lanebench)."""
    from tasks.engines.build import llama_cpp_bin_dir

    return llama_cpp_bin_dir()


@pytest.fixture(scope="session")
def prefect_harness():
    from prefect.testing.utilities import prefect_test_harness

    with prefect_test_harness(server_startup_timeout=120):
        yield


def shipped_inventory() -> dict:
    return yaml.safe_load((REPO / "hosts.yaml").read_text())


def write_inventory(folder: Path, data: dict) -> Path:
    """An inventory beside a link to the repo's testbed, so the shipped relative paths hold."""
    folder.mkdir(parents=True, exist_ok=True)
    link = folder / "testbed"
    if not link.exists():
        link.symlink_to(REPO / "testbed")
    path = folder / "hosts.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def run_cli(*args: str, timeout: float = 900) -> subprocess.CompletedProcess:
    """`lanebench ...` as a user runs it, in its own process (its own ephemeral Prefect)."""
    return subprocess.run([sys.executable, "-m", "flows.cli", *args], capture_output=True, text=True, cwd=REPO,
                          timeout=timeout)


def interrupt_cli(*args: str, when, timeout: float = 240, signal_name: str = "SIGINT"
                  ) -> tuple[subprocess.CompletedProcess, bool]:
    """`lanebench ...` in its own process group (as a terminal starts it), stopped once `when()`
    holds: SIGINT to the whole group, as Ctrl-C does, or SIGTERM to the process alone, as a
    service manager or `kill` does; (its result, whether the signal was sent)."""
    import signal
    import time

    cli = subprocess.Popen([sys.executable, "-m", "flows.cli", *args], cwd=REPO, stdout=subprocess.PIPE,
                           stderr=subprocess.PIPE, text=True, start_new_session=True)
    sent = False
    try:
        deadline = time.monotonic() + timeout
        while not sent and time.monotonic() < deadline and cli.poll() is None:
            if when():
                if signal_name == "SIGINT":
                    os.killpg(cli.pid, signal.SIGINT)
                else:
                    os.kill(cli.pid, getattr(signal, signal_name))
                sent = True
            time.sleep(0.05)
        out, err = cli.communicate(timeout=120)
    finally:
        if cli.poll() is None:
            os.killpg(cli.pid, signal.SIGKILL)
    return subprocess.CompletedProcess(cli.args, cli.returncode, out, err), sent


def run_folder_of(result: subprocess.CompletedProcess) -> Path:
    last = result.stdout.strip().splitlines()[-1]
    assert last.startswith("run folder: "), result.stdout + result.stderr
    return Path(last.removeprefix("run folder: "))


def manifest_of(folder: Path) -> dict:
    return json.loads((folder / "manifest.json").read_text())


def llama_server_pid(port: int) -> int | None:
    """The pid of a llama-server serving `port`, if any (read from /proc: procps may not be installed)."""
    for proc in Path("/proc").iterdir():
        if proc.name.isdigit():
            try:
                argv = (proc / "cmdline").read_bytes().split(b"\0")
            except OSError:
                continue
            if argv and b"llama-server" in argv[0] and b"--port" in argv[:-1] \
                    and argv[argv.index(b"--port") + 1] == str(port).encode():
                return int(proc.name)
    return None


def no_llama_server_left(ports: int | range = 18080) -> bool:
    """No llama-server left serving these ports. Each test file checks only its own ports: other
    suites' servers on a shared box are not its to judge."""
    return all(llama_server_pid(p) is None for p in ([ports] if isinstance(ports, int) else ports))
