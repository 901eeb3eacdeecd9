"""Every script under benchmarks/ runs, at tiny size, and exits 0 without a traceback.

A benchmark that only runs on a quiet machine is still run here, small: benchmarks/http_layers.py
stopped importing (b6c58bb) and benchmarks/load_generator.py exited 0 after printing a traceback,
and nobody saw either until a session ran them. A new script gets a line in SMOKE, or this fails.
The wall-time benchmarks (a whole nightly or matrix each: minutes) are started with --help here;
the flows they time run end to end in tests/test_rehearsal_lane.py and tests/test_matrix.py.
"""

from __future__ import annotations

import re
import socket
import subprocess
import sys
import time
import urllib.request

import pytest

from conftest import REPO



def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


PORT, LOADGEN_PORT, BURSTS_PORT = _free_port(), _free_port(), _free_port()  # others' tests may hold fixed ones
SMOKE: dict[str, list[str]] = {
    # starts fake_server.py itself, twice; the raw part on one core, then over two worker processes
    "load_generator.py": ["--smoke", "--peers", "none", "--port", str(LOADGEN_PORT), "--workers", "1,2",
                          "--client-cpus", "0,1", "--parent-cpu", "0"],
    "http_layers.py": ["--url", f"http://127.0.0.1:{PORT}", "--levels", "1,2", "--requests", "1", "--tokens", "8",
                       "--layers", "httpx,lean"],  # aiohttp is a peer's, not the project's
    "fake_server.py": ["--help"],  # served every run above
    "client_bursts.py": ["--levels", "1,2", "--max-tokens", "8", "--repeats", "1", "--port", str(BURSTS_PORT)],
    "peers.py": [],  # a module: importing it is all it does alone (peers install from the registry)
    "_common.py": [],  # a module: what the scripts share
    "engines_side_by_side.py": ["--help"],  # four lanes' nightlies: tens of minutes
    "matrix_wall_time.py": ["--help"],
    "nightly_overhead.py": ["--help"],
    "prefect_database.py": ["--help"],  # two Prefect servers and a PostgreSQL cluster: minutes on 2 cores
    "team_load.py": ["--help"],  # five flow runs' lanes one at a time: tens of minutes (tests/test_team.py is its CI size)
    "rehearsal_wall_time.py": ["--help"],
}


def test_every_benchmark_script_has_a_smoke_run():
    assert sorted(p.name for p in (REPO / "benchmarks").glob("*.py")) == sorted(SMOKE)


@pytest.fixture(scope="module")
def fake_server():
    proc = subprocess.Popen([sys.executable, str(REPO / "benchmarks/fake_server.py"), "--port", str(PORT),
                             "--zero-delay"], stdout=subprocess.PIPE, text=True)
    try:
        assert "listening" in proc.stdout.readline()
        yield
    finally:
        proc.terminate()
        proc.wait(10)


@pytest.mark.parametrize("script", sorted(SMOKE))
def test_a_benchmark_runs_and_exits_cleanly(script, fake_server):
    t = time.monotonic()
    r = subprocess.run([sys.executable, str(REPO / "benchmarks" / script), *SMOKE[script]], cwd=REPO,
                       capture_output=True, text=True, timeout=300)
    out = r.stdout + r.stderr
    assert r.returncode == 0 and "Traceback" not in out, out[-3000:]
    assert time.monotonic() - t < 120, "a smoke run is seconds, not minutes"
    if script == "load_generator.py":
        assert "## raw ceiling" in r.stdout and "coalesced %" in r.stdout and re.search(r"\| lanebench \| 4 \| 2 \| (\d+)/\1 \|", r.stdout)
        assert "## lanebench's scaling over cores" in r.stdout


def test_the_load_generator_exits_nonzero_when_a_part_fails(fake_server, tmp_path):
    """A benchmark that breaks part-way is no result: the HTTP layers part, run under a Python
    without the layer asked for, fails, and the script that ran it says so with its exit code."""
    r = subprocess.run([sys.executable, str(REPO / "benchmarks/http_layers.py"), "--url",
                        f"http://127.0.0.1:{PORT}", "--levels", "1", "--layers", "aiohttp"],
                       cwd=REPO, capture_output=True, text=True, timeout=120)
    assert r.returncode != 0
    with urllib.request.urlopen(f"http://127.0.0.1:{PORT}/stats") as resp:
        assert resp.status == 200


def test_the_load_generator_exits_nonzero_when_its_server_cannot_start(fake_server):
    """The load generator's own fake server cannot bind (the fixture's holds the port): one line
    that says so and a non-zero exit, not a table of nothing."""
    r = subprocess.run([sys.executable, str(REPO / "benchmarks/load_generator.py"), "--smoke", "--peers", "none",
                        "--port", str(PORT)], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert r.returncode != 0 and f"did not start on port {PORT}" in r.stderr, r.stdout + r.stderr
    assert "## raw ceiling" not in r.stdout


def test_a_raw_row_counts_tokens_over_the_clients_own_span(monkeypatch):
    """The raw ceiling's tok/s is tokens over the client's own first send to last response end.
    The fake server's busy span ends when its last write reached the socket buffers, before a
    slower client read it: one lanebench core at C=256 and 2 rounds read 690k tok/s at 3.2 µs of
    CPU a token on 2026-12-03, more than that core could do. The servers' span stays for their CPU."""
    monkeypatch.syspath_prepend(str(REPO / "benchmarks"))
    from load_generator import raw_row

    entries = [{"recv": 0.0, "writes": [0.001, 0.4], "conn": "7:1"}, {"recv": 0.4, "writes": [0.401, 0.5], "conn": "7:1"}]
    got = {"ok": 2, "n": 2, "tokens": 2048, "cpu_s": 0.5, "span_s": 2.0}  # the client read for 2 s
    row = raw_row("lanebench", got, entries, 1, 1, server_cpu_s=0.1, servers=1)
    assert row["tok/s"] == 1024.0 and row["server busy %"] == pytest.approx(20.0) and row["connections"] == 1


def test_weak_scaling_holds_each_worker_to_one_core_with_the_same_streams(monkeypatch):
    """`--streams-a-core 16`: C = 16 x cores, and "of linear" is against one core at C=16, the streams
    each worker keeps; against one core at the same C (64 on 4 cores) the split would read as loss."""
    monkeypatch.syspath_prepend(str(REPO / "benchmarks"))
    from load_generator import versus

    raw = [{"client": "lanebench", "C": c, "cores": n, "tok/s": t} for c, n, t in
           ((16, 1, 200e3), (32, 2, 390e3), (64, 4, 760e3), (64, 1, 265e3))]
    _, weak = versus(raw, ["lanebench"], streams_a_core=16)
    four = next(r for r in weak if r["cores"] == 4)
    assert four["of linear %"] == pytest.approx(95.0) and four["streams a worker"] == "16-16"
    _, strong = versus(raw, ["lanebench"])
    assert next(r for r in strong if r["cores"] == 4)["of linear %"] == pytest.approx(100 * 760 / (4 * 265))
