"""Faults of a serving server, with real processes (issue 27): a lane with an API key, and a server
that answers HTTP 5xx.

- The key reaches llama-server through its environment (LLAMA_API_KEY), never its argv; every
  request lanebench sends carries `Authorization: Bearer`, so the lane passes its gates and benches
  while a client without the key gets 401 from the same server; the key's value is written nowhere
  under the run folder or PREFECT_HOME. A key written in the inventory is a config error.
- A real HTTP front before a real llama-server (tests/failing_front.py) starts answering
  completions with HTTP 500 mid decode curve: the lane fails with one line naming the count and
  the status, and no later wave is sent.
"""

from __future__ import annotations

import json
import os
import secrets as pysecrets
import signal
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from tests.conftest import REPO, llama_server_pid, shipped_inventory, write_inventory
from tests.fault_lane import Nightly, kill, pidfile_pid, tiny_inventory, verify, wait_for

PORTS = range(18750, 18760)


def _bytes_under(root: Path, needle: bytes) -> list[str]:
    """Every file under `root` that holds `needle` (the SQLite database and its WAL included)."""
    hits = []
    for path in root.rglob("*"):
        if path.is_file() and not path.is_symlink():
            try:
                if needle in path.read_bytes():
                    hits.append(str(path))
            except OSError:
                continue
    return hits


def test_a_keyed_lane_passes_its_bench_and_its_key_is_nowhere(tmp_path, llama_bin, monkeypatch):
    """api_key_env: the server demands the key (401 without it, on completions and /metrics alike),
    lanebench sends it on every request (gates, smoke chat, capacity count, decode waves, prefill),
    and the value is on no argv and in no file lanebench or Prefect wrote."""
    port = PORTS[0]
    key = "lbk" + pysecrets.token_hex(9)  # short and not token-shaped: only "never written" keeps it out
    monkeypatch.setenv("LB_TEST_SERVER_KEY", key)
    inv = shipped_inventory()["lanes"]["rehearsal"]
    bench = {"repeats": 1, "decode": {"concurrency": [1, 2, 3], "max_tokens": 32, "requests_per_stream": 3,
                                      "prompts": "testbed/prompts/prose.jsonl"},
             "prefill": {"rungs": [32]}, "capacity": {}}
    hosts = tiny_inventory(tmp_path, port, bench=bench, agentic=inv["agentic"], api_key_env="LB_TEST_SERVER_KEY")
    n = Nightly(hosts, tmp_path / "artifacts", tmp_path / "prefect")
    try:
        n.wait_stage(("capacity plan", "warmup", "decode curve"), timeout=900)  # booted, gates passed: the key was sent
        pid = wait_for(lambda: pidfile_pid("rehearsal", port), 10, "the server's pidfile")
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
        environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        assert b"llama-server" in cmdline and key.encode() not in cmdline and b"--api-key" not in cmdline
        assert f"LLAMA_API_KEY={key}".encode() in environ  # the engine's own variable carries it
        base = f"http://127.0.0.1:{port}"
        body = {"prompt": "Once", "max_tokens": 1}
        assert httpx.get(f"{base}/health", timeout=10).status_code == 200  # llama-server exempts health
        for ask in (lambda h: httpx.post(f"{base}/v1/completions", json=body, headers=h, timeout=60),
                    lambda h: httpx.get(f"{base}/metrics", headers=h, timeout=10)):
            assert ask({}).status_code == 401  # the key is enforced: a client without it is refused
            assert ask({"Authorization": "Bearer not-the-key"}).status_code == 401
            assert ask({"Authorization": f"Bearer {key}"}).status_code == 200
        rc = n.wait(timeout=900)
    finally:
        _ended(n)
    out = n.output()
    assert rc == 0, out
    lane = n.manifest()["lanes"]["rehearsal"]
    assert lane["status"] == "passed", lane.get("reason")
    assert lane["config"]["api_key_env"] == "LB_TEST_SERVER_KEY"  # the reference is recorded, not the key
    requests = [json.loads(line) for line in (n.folder / "rehearsal" / "requests.jsonl").read_text().splitlines()]
    assert requests and all(r["ok"] and r["http_status"] == 200 for r in requests)
    assert {r["stage"] for r in requests} >= {"decode", "warmup"}
    leaks = _bytes_under(tmp_path / "artifacts", key.encode()) + _bytes_under(tmp_path / "prefect", key.encode())
    assert not leaks and key not in out, leaks
    assert verify(n.folder).returncode == 0
    assert llama_server_pid(port) is None


@pytest.mark.parametrize("lane_update, field", [
    ({"api_key": "lbk-inline-0123"}, "lanes.rehearsal.api_key"),
    ({"flags": ["--api-key", "lbk-inline-0123"]}, "lanes.rehearsal.flags[0]"),
    ({"env": {"LLAMA_API_KEY": "lbk-inline-0123"}}, "lanes.rehearsal.env.LLAMA_API_KEY"),
    ({"api_key_env": "A_KEY", "api_key_file": "key.txt"}, "lanes.rehearsal.api_key_file"),
])
def test_a_key_written_in_the_inventory_is_a_config_error(tmp_path, lane_update, field):
    """One line, exit 2, naming the field and the fix, and never echoing the key."""
    hosts = tiny_inventory(tmp_path, PORTS[1], **lane_update)
    r = subprocess.run([sys.executable, "-m", "flows.cli", "nightly", "--hosts", str(hosts), "--artifacts",
                        str(tmp_path / "artifacts")], capture_output=True, text=True, cwd=REPO, timeout=120,
                       env={**os.environ, "PREFECT_HOME": str(tmp_path / "prefect")})
    out = (r.stdout + r.stderr).strip()
    assert r.returncode == 2, out
    assert len(out.splitlines()) == 1 and "Traceback" not in out, out
    assert f"{field}:" in out and "Fix:" in out and "lbk-inline-0123" not in out, out


def test_an_engine_that_takes_a_key_only_on_argv_is_refused(tmp_path):
    """SGLang 0.5.23 reads its key from --api-key or a --config file only: a keyed SGLang lane is
    refused at load rather than put the key where `ps` shows it."""
    from tasks.inventory.base import ConfigError
    from tasks.inventory.load import load_inventory
    from tasks.engines import engine_for

    inv = shipped_inventory()
    lane = inv["lanes"]["rehearsal"]
    for k in ("agentic", "correctness", "flags", "gates", "drafter", "speculative"):
        lane.pop(k, None)
    lane.update(engine="sglang", api_key_env="LB_TEST_SERVER_KEY", binary="python3")
    lane["bench"] = {"decode": {"concurrency": [1], "prompts": "testbed/prompts/prose.jsonl"}}
    with pytest.raises(ConfigError) as e:
        load_inventory(write_inventory(tmp_path, inv), engine_for)
    assert e.value.field == "lanes.rehearsal.api_key_env" and "only on its command line" in e.value.problem


def test_an_unset_key_skips_the_lane_with_its_reason(tmp_path, monkeypatch):
    """The variable the lane names is not set where lanebench runs: skipped with that reason, before
    anything boots (exit 3: nothing measured)."""
    monkeypatch.delenv("LB_TEST_UNSET_KEY", raising=False)
    n = Nightly(tiny_inventory(tmp_path, PORTS[2], api_key_env="LB_TEST_UNSET_KEY"), tmp_path / "artifacts",
                tmp_path / "prefect")
    rc = n.wait(timeout=300)
    out = n.output()
    assert rc == 3, out
    lane = n.manifest()["lanes"]["rehearsal"]
    assert lane["status"] == "skipped" and "LB_TEST_UNSET_KEY is not set" in lane["reason"], lane


def _front(tmp_path: Path, llama_bin: Path) -> tuple[Path, Path, Path]:
    """The lane's binary: the failing front before the pinned llama-server."""
    fail, failed = tmp_path / "fail-now", tmp_path / "failed.log"
    wrapper = tmp_path / "llama-server-behind-front"
    wrapper.write_text(f"#!/bin/sh\nexec {sys.executable} {REPO / 'tests' / 'failing_front.py'} "
                       f"{llama_bin / 'llama-server'} {fail} {failed} \"$@\"\n")
    wrapper.chmod(0o755)
    return wrapper, fail, failed


def _decode(folder: Path) -> list[dict]:
    path = folder / "rehearsal" / "requests.jsonl"
    lines = path.read_text().splitlines() if path.exists() else []
    return [r for r in map(json.loads, lines) if r["stage"] == "decode"]


def _ended(n: Nightly) -> None:
    """A test that failed half-way leaves no nightly (nor the server it started) behind."""
    if n.proc.poll() is None:
        n.signal_group(signal.SIGTERM)
        n.proc.wait(120)


# Short requests, six a stream: after the first decode record (C=1) the fault lands in C=1 or C=2,
# so C=3 is a later wave that must not be sent. (Two a stream left C=1 and C=2 so short that a test
# process slowed by a loaded box once touched the cue after both had ended: CI, 2026-12-03.)
FIVE_XX_CURVE = {"repeats": 1, "decode": {"concurrency": [1, 2, 3], "max_tokens": 16, "requests_per_stream": 6,
                                          "prompts": "testbed/prompts/prose.jsonl"}}


def test_a_server_answering_5xx_fails_the_lane_and_no_later_wave_is_sent(tmp_path, llama_bin):
    """The front answers every completion HTTP 500 from the first decode record on: the lane fails
    with one line naming how many requests got which status, exit 1; every 500 the front sent is
    in the records of one wave and no request of a later wave reached the server."""
    port = PORTS[3]
    binary, fail, failed = _front(tmp_path, llama_bin)
    n = Nightly(tiny_inventory(tmp_path, port, bench=FIVE_XX_CURVE, binary=str(binary)), tmp_path / "artifacts",
                tmp_path / "prefect")
    try:
        folder = n.wait_stage(("decode curve",), timeout=900)
        wait_for(lambda: len(_decode(folder)) >= 1, 300, "a first decode record", step=0.02)
        fail.touch()
        rc = n.wait(timeout=600)
    finally:
        _ended(n)
    out = n.output()
    assert rc == 1, out
    lane = n.manifest()["lanes"]["rehearsal"]
    sent_500 = len(failed.read_text().splitlines()) if failed.exists() else 0
    assert sent_500 >= 1, "the front never failed a request: the test proves nothing"
    assert lane["status"] == "failed" and f"{sent_500} x HTTP 500" in lane["reason"], (sent_500, lane["reason"])
    assert "later waves are not sent" in lane["reason"] and "\n" not in lane["reason"]
    assert any(f"{sent_500} x HTTP 500" in line for line in out.splitlines()), out
    decode = _decode(n.folder)
    bad = [r for r in decode if r["http_status"] == 500]
    assert len(bad) == sent_500  # every 500 is recorded, and none was answered to a request not recorded
    failing = {(r["repeat"], r["concurrency"]) for r in bad}
    assert len(failing) == 1, failing  # one wave met the failure ...
    ((repeat, level),) = failing
    later = [r for r in decode if (r["repeat"], r["concurrency"]) > (repeat, level)]
    assert level < max(FIVE_XX_CURVE["decode"]["concurrency"]), "the failure hit the last wave: nothing to hold back"
    assert later == []  # ... and no later wave was sent
    assert verify(n.folder).returncode == 0, verify(n.folder).stdout
    if (pid := pidfile_pid("rehearsal", port)) is not None:
        kill(pid)
        pytest.fail("the front (and its llama-server) were left running")
    print(f"\n[reliability] HTTP 500 mid-curve: {sent_500} failed in wave C={level}; load "
          f"{Path('/proc/loadavg').read_text().split()[0]}; reason: {lane['reason'][:200]}")
