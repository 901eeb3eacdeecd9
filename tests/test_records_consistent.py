"""A run folder is consistent at every moment; history serves no number from a tampered table;
a run whose process died is marked interrupted by the next run."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid
from pathlib import Path

from pydantic import BaseModel

from tasks.record.audit import audit
from tasks.record.history import open_index
from tasks.record.interrupted import reclaim_dead_runs, refresh_marked
from tasks.record.run_folder import RunFolder
from tests.test_history import _run

REPO = Path(__file__).resolve().parent.parent


class _Rec(BaseModel):
    prompt_id: str
    ok: bool = True


def _record(i: int) -> _Rec:
    return _Rec(prompt_id=f"p{i}")


def test_raw_records_are_listed_as_they_are_written(tmp_path):
    """A raw file is in the manifest from its first record; its hash is refreshed by the next
    manifest save (every stage mark, table and the run's end make one), not per record: a
    record is appended inside a wave's event loop. A run that dies between saves is re-hashed by
    the run that reclaims it (the next test)."""
    run = RunFolder(tmp_path, "nightly", str(uuid.uuid4()), REPO / "hosts.yaml")
    run.append_jsonl("l", "requests.jsonl", _record(0))
    on_disk = json.loads((run.path / "manifest.json").read_text())
    assert [a["path"] for a in on_disk["artifacts"]] == ["l/requests.jsonl"]  # listed at once
    assert audit(run.path).ok, audit(run.path)
    for i in range(1, 3):
        run.append_jsonl("l", "requests.jsonl", _record(i))
    run.stage("l", "decode curve")  # a stage mark saves the manifest: verify passes again
    assert audit(run.path).ok, audit(run.path)
    (run.path / "l" / "boot.log").write_text("a server line\n")
    run.append_jsonl("l", "requests.jsonl", _record(3))
    run.finish()
    assert audit(run.path).ok, audit(run.path)
    assert len((run.path / "l" / "requests.jsonl").read_text().splitlines()) == 4
    kinds = {a.path: a.kind for a in run.manifest.artifacts}
    assert kinds == {"l/requests.jsonl": "raw", "l/boot.log": "boot-log"}


def test_a_dead_runs_folder_is_marked_interrupted_by_the_next(tmp_path):
    run = RunFolder(tmp_path, "nightly", str(uuid.uuid4()), REPO / "hosts.yaml")
    run.lane("l").stage = "decode curve"
    run.append_jsonl("l", "requests.jsonl", _record(0))
    child = subprocess.Popen(["true"])
    child.wait()
    run.manifest.flow.owner = run.manifest.flow.owner.model_copy(update={"pid": child.pid, "start": "1"})  # a process gone
    run.save_manifest()
    run.append_jsonl("l", "requests.jsonl", _record(1))  # written after the last save, then the process died
    (run.path / "manifest.json.tmp").write_text("{half")
    assert not audit(run.path).ok
    lines = reclaim_dead_runs(tmp_path, by="next-run")
    assert len(lines) == 1 and "marked interrupted" in lines[0] and f"pid {child.pid}" in lines[0]
    m = json.loads((run.path / "manifest.json").read_text())
    assert m["flow"]["status"] == "interrupted" and m["lanes"]["l"]["status"] == "interrupted"
    assert m["lanes"]["l"]["reason"].startswith("decode curve: interrupted")
    os.unlink(run.path / "manifest.json.tmp") if (run.path / "manifest.json.tmp").exists() else None
    assert audit(run.path).ok
    assert reclaim_dead_runs(tmp_path, by="again") == []  # marked once
    assert not (run.path / ".seals").exists() or audit(run.path).extra == []
    live = RunFolder(tmp_path, "nightly", str(uuid.uuid4()), REPO / "hosts.yaml")  # this process: alive
    assert reclaim_dead_runs(tmp_path, by="x") == [] and live.manifest.flow.status == "running"


def test_history_refuses_a_tampered_table(tmp_path):
    inventory = REPO / "hosts.yaml"
    good = _run(tmp_path, "nightly", {"rehearsal": {"tok_s": 20.0}}, inventory)
    bad = _run(tmp_path, "nightly", {"rehearsal": {"tok_s": 21.0}}, inventory)
    table = bad.path / "rehearsal" / "decode.parquet"
    table.write_bytes(table.read_bytes() + b"\0")
    con = open_index(tmp_path)
    refused = con.execute("SELECT run, path FROM refused").fetchall()
    assert refused == [(bad.path.name, "rehearsal/decode.parquet")]
    runs = {r for (r,) in con.execute("SELECT DISTINCT run FROM metrics WHERE metric LIKE 'tok_s@%'").fetchall()}
    assert runs == {good.path.name}
    r = subprocess.run([sys.executable, "-m", "flows.cli", "history", "--artifacts", str(tmp_path), "runs"],
                       cwd=REPO, capture_output=True, text=True, timeout=120)
    assert f"history: refused {bad.path.name}/rehearsal/decode.parquet" in r.stderr, r.stderr


_SIGTERM_IN_A_CALLBACK = """
import asyncio, os, signal, sys
sys.path.insert(0, sys.argv[1])
from tasks.record.interrupted import install_stop_handlers, interrupts, stop_requested
import prefect.utilities.engine as engine

install_stop_handlers()
signal.signal(signal.SIGTERM, engine._prefect_sigterm_handler)  # what Prefect installs while a flow runs

async def wave():
    def readable():  # a socket callback, as the wave's client runs them
        os.kill(os.getpid(), signal.SIGTERM)
        for _ in range(1000):  # the handler runs between these bytecodes
            pass
    asyncio.get_running_loop().call_soon(readable)
    await asyncio.sleep(0.5)
    return "the wave went on"

try:
    print(asyncio.run(wave()))
except interrupts() as e:
    print("stopped:", type(e).__name__, stop_requested())
"""


def test_sigterm_inside_an_event_loop_callback_stops_the_run():
    """SIGTERM landing while the event loop runs a callback (a wave reading its sockets) stops the
    run: asyncio must not log the exception and carry on (it did for Prefect's TerminationSignal)."""
    r = subprocess.run([sys.executable, "-c", _SIGTERM_IN_A_CALLBACK, str(REPO)], capture_output=True, text=True,
                       timeout=120)
    assert r.stdout.strip() == "stopped: Terminated SIGTERM", r.stdout + r.stderr
    assert "Exception in callback" not in r.stderr, r.stderr


def test_a_record_edited_after_the_crash_is_not_blessed_by_the_reclaim(tmp_path):
    """Issue 27: after lanebench died, a record's output_tokens was edited (here its prompt id); the reclaim re-hashed it
    and verify said 0 changed. Records are sealed as appended: the reclaim names the file, keeps
    the sealed digest, and verify fails; bytes appended by anyone else are named too."""
    run = RunFolder(tmp_path, "nightly", str(uuid.uuid4()), REPO / "hosts.yaml")
    run.lane("l").stage = "decode curve"
    for i in range(3):
        run.append_jsonl("l", "requests.jsonl", _record(i))
    run.append_jsonl("l", "prefill.jsonl", _record(9))
    child = subprocess.Popen(["true"])
    child.wait()
    run.manifest.flow.owner = run.manifest.flow.owner.model_copy(update={"pid": child.pid, "start": "1"})
    run.save_manifest()
    path = run.path / "l" / "requests.jsonl"
    path.write_text(path.read_text().replace('"prompt_id":"p1"', '"prompt_id":"p7"', 1))
    assert '"prompt_id":"p7"' in path.read_text()
    with (run.path / "l" / "prefill.jsonl").open("a") as f:
        f.write(_record(10).model_dump_json() + "\n")
    lines = reclaim_dead_runs(tmp_path, by="next-run")
    assert len(lines) == 1 and "changed after the crash, not re-hashed: l/prefill.jsonl, l/requests.jsonl" in lines[0]
    result = audit(run.path)
    assert not result.ok and result.changed == ["l/prefill.jsonl", "l/requests.jsonl"], result
    assert any("l/requests.jsonl: its records differ" in p for p in result.problems), result.problems
    refresh_marked(tmp_path, by="next-run")  # the reclaiming run's second look re-blesses nothing either
    assert audit(run.path).changed == ["l/prefill.jsonl", "l/requests.jsonl"]
