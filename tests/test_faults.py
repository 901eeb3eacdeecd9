"""Faults injected into the rehearsal lane (one short boot, tiny benches): each test asserts the
end state a person finds at 9 a.m. (status and reason, records kept, nothing left running, the
exit code), and how long the run took to end. docs/reliability.md is the table of these tests.
"""

from __future__ import annotations

import json
import signal
import subprocess
import time
from pathlib import Path

import pytest

from tests.conftest import llama_server_pid, shipped_inventory, write_inventory
from tests.fault_lane import LONG_CURVE, Nightly, kill, pidfile_pid, tiny_inventory, uvicorn_servers_of, verify, wait_for

PORTS = range(18190, 18199)


def _started_by(pid: int, tmp_path: Path) -> bool:
    """Whether a process inherited this test's PREFECT_HOME (every run a test starts has its own):
    other sessions run these tests, on these ports, on the same machine."""
    try:
        env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    except OSError:
        return False
    return any(v.startswith(f"PREFECT_HOME={tmp_path}/".encode()) for v in env)


@pytest.fixture(autouse=True)
def no_leftovers(tmp_path):
    yield
    for port in PORTS:  # whatever a test did, it leaves no server of its own (and kills no one else's)
        if (pid := llama_server_pid(port)) is not None and _started_by(pid, tmp_path):
            kill(pid)
            pytest.fail(f"a llama-server was left on port {port}")


def _records(folder: Path) -> int:
    path = folder / "rehearsal" / "requests.jsonl"
    return len(path.read_text().splitlines()) if path.exists() else 0


def test_nothing_measured_is_not_passed(tmp_path):
    """Every lane skipped by a precondition: exit 3 and a line that says nothing was measured."""
    inv = shipped_inventory()
    lane = inv["lanes"]["rehearsal"]
    lane["model"] = {"path": "testbed/models/absent.gguf"}
    hosts = write_inventory(tmp_path, inv)
    n = Nightly(hosts, tmp_path / "artifacts", tmp_path / "prefect")
    rc = n.wait()
    out = n.output()
    assert rc == 3, out
    assert "nightly measured nothing (1 skipped)" in out and "absent.gguf is missing" in out
    assert "passed" not in out.splitlines()[-2]
    assert n.manifest()["flow"]["verdict"]["outcome"] == "nothing-measured"


@pytest.mark.parametrize("how", ["SIGINT to the process group", "SIGTERM to the process"])
def test_interrupt_tears_down_and_marks_interrupted(tmp_path, llama_bin, how):
    """Ctrl-C (a terminal signals the whole group) or SIGTERM mid-run: ends within seconds, the
    server is torn down, the run is marked interrupted, verify passes, and the Prefect API server
    (its own session) outlived the signal to report the end, then stopped."""
    port = PORTS[0] if how.startswith("SIGINT") else PORTS[1]
    home = tmp_path / "prefect"
    n = Nightly(tiny_inventory(tmp_path, port, bench=LONG_CURVE), tmp_path / "artifacts", home)
    folder = n.wait_stage(("warmup", "decode curve"))
    assert pidfile_pid("rehearsal", port) is not None
    t0 = time.monotonic()
    if how.startswith("SIGINT"):
        n.signal_group(signal.SIGINT)
    else:
        n.proc.send_signal(signal.SIGTERM)
    rc = n.wait(timeout=60)
    took = time.monotonic() - t0
    out = n.output()
    sig = "SIGINT" if how.startswith("SIGINT") else "SIGTERM"
    assert rc == 130, out
    assert f"nightly interrupted by {sig}" in out and "Error logging to API" not in out, out
    assert took < 30, f"took {took:.1f} s to end"
    m = json.loads((folder / "manifest.json").read_text())
    assert m["flow"]["status"] == "interrupted"
    assert m["lanes"]["rehearsal"]["status"] == "interrupted" and sig in m["lanes"]["rehearsal"]["reason"]
    assert verify(folder).returncode == 0, verify(folder).stdout
    assert not (folder / "manifest.json.tmp").exists()
    assert llama_server_pid(port) is None and uvicorn_servers_of(home) == []
    assert pidfile_pid("rehearsal", port) is None  # no stale pidfile outlives the run (issue 27)
    print(f"\n[reliability] {how}: ended in {took:.1f} s, {_records(folder)} records kept")


def test_ctrl_c_stops_lanebench_tools_like_nightly(tmp_path, llama_bin):
    """`lanebench tools` shares the nightly's way of running (flows/cli/__init__.py `run_flow`): Ctrl-C to its
    process group mid tool gate ends it with exit 130, the lane torn down (no llama-server on the
    run's port), the run folder marked interrupted (verify passes), its API server gone."""
    port = PORTS[7]
    inv = shipped_inventory()
    lane = inv["lanes"]["rehearsal"]
    lane["port"] = port
    hosts = write_inventory(tmp_path, inv)
    home = tmp_path / "prefect"
    n = Nightly(hosts, tmp_path / "artifacts", home, command="tools")
    folder = n.wait_stage(("boot gates", "tool gate"))
    wait_for(lambda: llama_server_pid(port), 30, "the lane's server")
    t0 = time.monotonic()
    n.signal_group(signal.SIGINT)
    rc = n.wait(timeout=60)
    took = time.monotonic() - t0
    out = n.output()
    assert rc == 130, out
    assert "tools interrupted by SIGINT" in out and "Error logging to API" not in out, out
    assert out.strip().splitlines()[-1] == f"run folder: {folder}"
    m = json.loads((folder / "manifest.json").read_text())
    assert m["flow"]["status"] == "interrupted" and m["flow"]["interrupted_by"] == "SIGINT", m["flow"]
    assert m["lanes"]["rehearsal"]["status"] == "interrupted" and "SIGINT" in m["lanes"]["rehearsal"]["reason"]
    assert verify(folder).returncode == 0, verify(folder).stdout
    assert llama_server_pid(port) is None and uvicorn_servers_of(home) == []
    print(f"\n[reliability] tools, SIGINT in {m['lanes']['rehearsal']['reason'].split(':')[0]}: ended in {took:.1f} s")


def test_sigkill_then_next_night_reclaims_and_keeps_secrets_out(tmp_path, llama_bin):
    """lanebench SIGKILLed mid decode curve: the server is orphaned, the manifest says running. The
    next nightly marks that run interrupted (verify passes on it), stops the orphan from its
    pidfile, releases the dead holder's host-lock lease at once, and passes. The lane declares
    secrets; no value is written under either run folder or in Prefect's database."""
    port = PORTS[2]
    token, declared = "tok-9f3a1c77e2", "decl-51b0d6aa42"
    slots = tmp_path / "slots-c04e19d7b3"  # a flag whose value llama-server checks (an existing folder)
    slots.mkdir()
    flag_value = str(slots)
    hosts = tiny_inventory(tmp_path, port, bench=LONG_CURVE, env={"HF_TOKEN": token, "PLAIN_NAME": declared},
                           flags=["--spec-draft-n-min", "0", "--slot-save-path", flag_value],
                           secrets=["PLAIN_NAME", "--slot-save-path"])
    home = tmp_path / "prefect"
    first = Nightly(hosts, tmp_path / "artifacts", home)
    dead = first.wait_stage(("decode curve",))
    wait_for(lambda: _decode_records(dead) >= 1, 60, "a first decode record", step=0.02)
    first.proc.kill()  # SIGKILL to lanebench alone: no teardown runs
    first.wait(timeout=30)
    orphan = wait_for(lambda: llama_server_pid(port), 10, "the orphaned server")
    assert json.loads((dead / "manifest.json").read_text())["flow"]["status"] == "running"
    time.sleep(2)  # the PDEATHSIG'd API server goes

    t0 = time.monotonic()
    second = Nightly(hosts, tmp_path / "artifacts", home)
    rc = second.wait(timeout=400)
    took = time.monotonic() - t0
    out = second.output()
    assert rc == 0, out
    assert f"run {dead.name}: marked interrupted" in out
    assert "reclaimed: a dead run's server for lane rehearsal" in out
    m = second.manifest()
    hold = m["lanes"]["rehearsal"]["host_lock"]
    assert hold["waited_s"] < 15 and hold["reclaimed"] >= 1, hold  # released at once, not after a lease timeout
    assert llama_server_pid(port) is None and not Path(f"/proc/{orphan}").exists()
    old = json.loads((dead / "manifest.json").read_text())
    assert old["flow"]["status"] == "interrupted" and old["lanes"]["rehearsal"]["status"] == "interrupted"
    assert "died" in old["lanes"]["rehearsal"]["reason"]
    assert any(a["path"] == "rehearsal/requests.jsonl" for a in old["artifacts"]) and _records(dead) >= 1
    assert verify(dead).returncode == 0, verify(dead).stdout
    assert verify(second.folder).returncode == 0
    # Secrets: redacted in both folders and in Prefect's database, though the server got them.
    assert "REDACTED" in (second.folder / "manifest.json").read_text()
    for value in (token, declared, flag_value):
        found = subprocess.run(["grep", "-rlaF", value, str(tmp_path / "artifacts"), str(home)],
                               capture_output=True, text=True).stdout
        assert found == "", f"{value} written to: {found}"
    print(f"\n[reliability] SIGKILL then next night: next night ended in {took:.1f} s; "
          f"{_records(dead)} records of the dead run kept")


def test_a_boot_error_echoing_a_secret_flag_stays_out_of_prefect(tmp_path, llama_bin):
    """The server refuses a secret flag's value and echoes it ("not a directory: <value>"): the boot
    task raises with that log tail, so Prefect's failure message, the traceback it logs and the
    task-run state event all carry the value. The lane fails (exit 1) naming the refusal; neither the
    run folder nor PREFECT_HOME (its SQLite database) holds the value, though the error reached it."""
    port = PORTS[6]
    token, missing = "tok-7be0c2d91a", str(tmp_path / "no-such-folder-e5a0b3c6d2")
    hosts = tiny_inventory(tmp_path, port, env={"HF_TOKEN": token}, flags=["--slot-save-path", missing],
                           secrets=["--slot-save-path"])
    home = tmp_path / "prefect"
    n = Nightly(hosts, tmp_path / "artifacts", home)
    rc = n.wait(timeout=300)
    out = n.output()
    assert rc == 1, out
    lane = n.manifest()["lanes"]["rehearsal"]
    assert lane["status"] == "failed" and "not a directory: REDACTED" in lane["reason"], lane
    for value in (token, missing):
        found = subprocess.run(["grep", "-rlaF", value, str(tmp_path / "artifacts"), str(home)],
                               capture_output=True, text=True).stdout
        assert found == "", f"{value} written to: {found}"
        assert value not in out
    reached = subprocess.run(["grep", "-rlaF", "not a directory: REDACTED", str(home)], capture_output=True, text=True)
    assert reached.stdout, "the boot error never reached Prefect's database: the test proves nothing"
    assert llama_server_pid(port) is None and verify(n.folder).returncode == 0, verify(n.folder).stdout


def test_server_killed_mid_curve_is_named(tmp_path, llama_bin):
    """The server dies mid decode curve: the lane fails at once naming the dead server (not a
    metrics scrape), the records so far are kept and listed, exit 1."""
    port = PORTS[3]
    n = Nightly(tiny_inventory(tmp_path, port, bench=LONG_CURVE), tmp_path / "artifacts", tmp_path / "prefect")
    folder = n.wait_stage(("decode curve",))
    wait_for(lambda: _decode_records(folder) >= 1, 60, "a decode record", step=0.02)
    t0 = time.monotonic()
    kill(wait_for(lambda: pidfile_pid("rehearsal", port), 10, "the server's pidfile"))
    rc = n.wait(timeout=120)
    out = n.output()
    assert rc == 1, out
    lane = n.manifest()["lanes"]["rehearsal"]
    assert lane["status"] == "failed" and "server died" in lane["reason"] and "metric" not in lane["reason"], lane
    assert verify(n.folder).returncode == 0 and _records(n.folder) >= 1
    print(f"\n[reliability] server killed: ended in {time.monotonic() - t0:.1f} s; reason: {lane['reason'][:80]}")


def _state(pid: int) -> str | None:
    """A process's state letter (T: stopped, Z: zombie), None once it is gone."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return None


def test_server_stopped_mid_curve_ends_at_the_deadline(tmp_path, llama_bin, monkeypatch):
    """The server is SIGSTOPped with a decode request in flight (its 30 s SSE pings stop too, but
    even a pinging stream never trips a read timeout): the request ends at the lane's declared wall
    deadline, the next check finds the health silent, and the lane fails naming the stage, the
    deadline and the stopped server; the stopped server is torn down (it acts on SIGTERM only once
    continued) and nothing is left; the records so far, the late one among them, are kept, exit 1."""
    port, deadline = PORTS[8], 12
    # The declared wall deadline is what this test holds; the stall bound from the lane's own steady
    # state (test_faults_proof.py) would cut the request first on a quiet box (its floor is 10 s).
    monkeypatch.setenv("LANEBENCH_STALL_FLOOR_S", "300")
    bench = {"repeats": 1, "decode": {"concurrency": [1, 2, 3], "max_tokens": 48, "requests_per_stream": 3,
                                      "deadline_s": deadline, "prompts": "testbed/prompts/prose.jsonl"}}
    n = Nightly(tiny_inventory(tmp_path, port, bench=bench), tmp_path / "artifacts", tmp_path / "prefect")
    folder = n.wait_stage(("decode curve",))
    server = wait_for(lambda: pidfile_pid("rehearsal", port), 10, "the server's pidfile")
    # The first record of a stream of three: the stream's next request is on its way.
    wait_for(lambda: _decode_records(folder) >= 1, 120, "a first decode record", step=0.02)
    kill(server, signal.SIGSTOP)
    t0, stopped_at = time.monotonic(), time.time()
    wait_for(lambda: _state(server) == "T", 5, "the server to be stopped", step=0.01)  # delivered asynchronously
    rc = n.wait(timeout=120)
    took = time.monotonic() - t0
    out = n.output()
    assert rc == 1, out
    m = n.manifest()
    lane = m["lanes"]["rehearsal"]
    assert lane["status"] == "failed" and lane["reason"].startswith("decode curve: "), lane
    # Stopped with a request in flight: it runs to the wall deadline. Stopped just as a wave ended
    # (a race on 2 cores): the between-wave check finds the health silent first. Both name the stop.
    at_deadline = f"{deadline} s wall deadline" in lane["reason"]
    assert "stopped answering" in lane["reason"], lane["reason"]
    assert took < deadline + 45, f"took {took:.1f} s to end"
    late = [json.loads(line) for line in (n.folder / "rehearsal" / "requests.jsonl").read_text().splitlines()]
    assert not at_deadline or any((r["error"] or "").startswith("deadline:") and r["stage"] == "decode" for r in late)
    assert any(a["path"] == "rehearsal/requests.jsonl" for a in m["artifacts"])
    assert verify(n.folder).returncode == 0, verify(n.folder).stdout
    assert _state(server) is None and llama_server_pid(port) is None  # gone, not left stopped
    lane_took = next(t["at"] for t in lane["timeline"] if t["stage"] == "done") - stopped_at
    print(f"\n[reliability] server stopped: lane torn down in {lane_took:.1f} s, process ended in {took:.1f} s "
          f"(deadline {deadline} s), "
          f"{_records(n.folder)} records kept; load {Path('/proc/loadavg').read_text().split()[0]}; "
          f"reason: {lane['reason'][:160]}")


def _decode_records(folder: Path) -> int:
    path = folder / "rehearsal" / "requests.jsonl"
    lines = path.read_text().splitlines() if path.exists() else []
    return sum('"stage":"decode"' in line for line in lines)


@pytest.fixture
def small_disk(tmp_path):
    mount = tmp_path / "disk"
    mount.mkdir()
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=8m", "tmpfs", str(mount)], capture_output=True, text=True)
    if r.returncode != 0:
        pytest.fail(f"cannot mount a small tmpfs (needs root): {r.stderr}")
    yield mount
    subprocess.run(["umount", "-l", str(mount)], check=False)


def test_disk_full_mid_run_keeps_records_and_a_consistent_manifest(tmp_path, llama_bin, small_disk, monkeypatch):
    """The artifacts disk fills mid-run: the lane ends with one line, every record written so far is
    kept and listed, no manifest.json.tmp, verify passes, exit 1."""
    port = PORTS[4]
    monkeypatch.setenv("LANEBENCH_MIN_FREE_MB", "2")  # preflight's free-space check passes; the fill comes later
    n = Nightly(tiny_inventory(tmp_path, port, bench=LONG_CURVE), small_disk / "artifacts", tmp_path / "prefect")
    folder = n.wait_stage(("warmup", "decode curve"))
    wait_for(lambda: _records(folder) >= 1, 120, "a first record", step=0.02)
    filler = small_disk / "filler"
    subprocess.run(["dd", "if=/dev/zero", f"of={filler}", "bs=64k"], capture_output=True)  # until the disk is full
    t0 = time.monotonic()
    rc = n.wait(timeout=300)
    out = n.output()
    assert rc == 1, out
    assert "Traceback" not in out, out
    m = json.loads((folder / "manifest.json").read_text())
    lane = m["lanes"]["rehearsal"]
    assert lane["status"] == "failed" and "disk full" in lane["reason"] and "Errno" not in lane["reason"], lane
    assert _records(folder) >= 1 and any(a["path"] == "rehearsal/requests.jsonl" for a in m["artifacts"])
    assert not (folder / "manifest.json.tmp").exists()
    filler.unlink()
    assert verify(folder).returncode == 0, verify(folder).stdout
    print(f"\n[reliability] disk full: ended {time.monotonic() - t0:.1f} s after the disk filled; "
          f"{_records(folder)} records kept; reason: {lane['reason'][:90]}")


def test_preflight_skips_a_lane_when_the_run_folder_disk_is_short(tmp_path, small_disk, monkeypatch):
    """Less free space than a lane may write: skipped with the reason before anything boots (exit 3)."""
    monkeypatch.setenv("LANEBENCH_MIN_FREE_MB", "64")
    n = Nightly(tiny_inventory(tmp_path, PORTS[5]), small_disk / "artifacts", tmp_path / "prefect")
    rc = n.wait()
    lane = n.manifest()["lanes"]["rehearsal"]
    assert rc == 3 and lane["status"] == "skipped" and "MiB free" in lane["reason"], n.output()
