"""The typed manifest reads run folders written before it existed, and is the one way in.

tests/fixtures/run-folders-v0 holds folders written by lanebench at faf9901 (no
`schema_version`): they read through the v0 migration, verify, show in history, and the dead one
is reclaimed through `RunFolder.reopen` like any folder of today. The H200 manifests
(tests/fixtures/gpu-h200) are real runs of the same shape.
"""

from __future__ import annotations

import json
import re
import shutil
import socket
import subprocess
from pathlib import Path

import pytest

from tasks.record.audit import audit
from tasks.record.history import scan
from tasks.record.interrupted import reclaim_dead_runs, refresh_marked
from tasks.record.manifest import SCHEMA_VERSION, ManifestError, parse_manifest, read_manifest
from tasks.record.run_folder import RunFolder

FIXTURES = Path(__file__).resolve().parent / "fixtures"
V0 = FIXTURES / "run-folders-v0"
ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def v0(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("LANEBENCH_LEDGER_DIR", str(tmp_path / "ledger"))
    root = tmp_path / "artifacts"
    for folder in V0.glob("2026*"):
        shutil.copytree(folder, root / folder.name)
    return root


def _folder(root: Path, pattern: str) -> Path:
    (found,) = root.glob(pattern)
    return found


def test_folders_written_before_the_schema_read_and_verify(v0: Path) -> None:
    nightly, matrix = _folder(v0, "*_nightly_0f1e2d3c"), _folder(v0, "*_matrix_1f1e2d3c")
    m = read_manifest(nightly)
    assert m.schema_version == SCHEMA_VERSION and m.lanebench.git_sha.startswith("faf9901")
    lane = m.lanes["rehearsal"]
    assert lane.host_lock is not None and lane.host_lock.limit == "gpu:localhost"
    assert lane.gpu.before is not None and lane.gpu.before.gpus[0].name == "NVIDIA H200"
    assert lane.gates[0].gate == "capacity" and lane.bandwidth is not None and lane.bandwidth.memory_gbps == 20.0
    assert m.flow.correctness["rehearsal"].gates[0].requests[0].seconds == 0.2
    assert m.flow.verdict is not None and m.flow.verdict.line == "ok: 1 lane passed"
    assert m.flow.comparison_refused == {"other": "other: fingerprint differs (engine)"}
    kl = read_manifest(matrix).flow.kl
    assert kl is not None and kl.headline == "PASS" and kl.flags == ["a flag: why"]  # moved in from beside it
    assert audit(nightly).ok and audit(nightly).checked == 3 and audit(matrix).ok
    runs, lanes, _ = scan(v0)
    assert set(runs.run) == {p.name for p in v0.iterdir()} and set(lanes.lane) == {"rehearsal", "a1"}


def test_a_dead_v0_run_is_reclaimed_through_the_run_folder_and_then_verifies(v0: Path) -> None:
    dead = _folder(v0, "*_nightly_2f1e2d3c")
    m = json.loads((dead / "manifest.json").read_text())  # the dead writer was on this host, before a reboot
    m["flow"]["owner"].update(hostname=socket.gethostname(), boot_id="a boot long gone")
    (dead / "manifest.json").write_text(json.dumps(m, indent=2))
    assert not audit(dead).ok  # never saved after its last record: the seal is ahead of the manifest

    (line,) = reclaim_dead_runs(v0, by="20261203T000000Z_nightly_feedface")
    assert line.startswith(f"run {dead.name}: marked interrupted") and "lanes rehearsal did not finish" in line
    after = read_manifest(dead)
    assert after.schema_version == SCHEMA_VERSION and after.flow.status == "interrupted"
    assert after.flow.reclaim is not None and after.flow.reclaim.changed_after_crash == []
    assert after.lanes["rehearsal"].status == "interrupted" and after.lanes["rehearsal"].reason.startswith("bench: ")
    result = audit(dead)
    assert result.ok and result.ledger.startswith("verified"), result
    assert not (dead / ".reserve").exists()

    log = dead / "rehearsal" / "server.log"  # its server wrote on until the reclaiming lane stopped it
    log.write_text("late line\n")
    refresh_marked(v0, by="20261203T000000Z_nightly_feedface")
    assert audit(dead).ok and "rehearsal/server.log" in {a.path for a in read_manifest(dead).artifacts}
    assert reclaim_dead_runs(v0, by="another") == []  # marked once


def test_a_raw_record_edited_after_the_crash_is_named_not_rehashed(v0: Path) -> None:
    dead = _folder(v0, "*_nightly_2f1e2d3c")
    m = json.loads((dead / "manifest.json").read_text())
    m["flow"]["owner"].update(hostname=socket.gethostname(), boot_id="a boot long gone")
    (dead / "manifest.json").write_text(json.dumps(m, indent=2))
    raw = dead / "rehearsal" / "requests.jsonl"
    raw.write_text(raw.read_text().replace('"output_tokens":64', '"output_tokens":71', 1))
    (line,) = reclaim_dead_runs(v0, by="x")
    assert "changed after the crash, not re-hashed: rehearsal/requests.jsonl" in line
    result = audit(dead)
    assert "rehearsal/requests.jsonl" in result.changed
    assert any("changed after the run died" in p and "differ from what lanebench wrote" in p for p in result.problems)


@pytest.mark.parametrize("run", ("run1", "run2"))
def test_real_h200_manifests_read_and_write_back_the_same(run: str) -> None:
    text = (FIXTURES / "gpu-h200" / f"manifest-{run}.json").read_text()
    m = parse_manifest(text)
    assert all(lane.host_lock is not None for lane in m.lanes.values())
    assert parse_manifest(m.model_dump_json()) == m  # what RunFolder writes reads back unchanged


def test_a_manifest_that_is_not_one_is_one_line(tmp_path: Path) -> None:
    for text, why in (("{", "not valid JSON"), ("[]", "not a JSON object"),
                      ('{"schema_version": 99, "flow": {}}', "schema_version 99 is newer"),
                      ('{"schema_version": 1, "flow": {"name": "x", "flow_run_id": "y", "started_at": "z"}}',
                       "artifacts: Field required")):
        with pytest.raises(ManifestError, match=re.escape(why)):
            parse_manifest(text, "f/manifest.json")
    (tmp_path / "manifest.json").write_text('{"flow": {"name": "x", "flow_run_id": "y", "started_at": "z"}}')
    (problem,) = audit(tmp_path).problems
    assert problem.startswith("manifest.json: artifacts: Field required")


def test_reopen_writes_through_the_one_writer(v0: Path) -> None:
    folder = _folder(v0, "*_nightly_0f1e2d3c")
    run = RunFolder.reopen(folder)
    with run.edit() as m:
        m.flow.reclaimed.append("a line")
    assert read_manifest(folder).flow.reclaimed[-1] == "a line"


def test_a_manifest_is_parsed_in_one_function() -> None:
    """`json.loads` of a manifest outside tasks/record/manifest.py: none (tests aside)."""
    found = subprocess.run(["git", "grep", "-n", "-E", r"json\.loads?\(", "--", "*.py", ":!tests"],
                           cwd=ROOT, capture_output=True, text=True).stdout.splitlines()
    near = [line for line in found if "manifest" in line.lower()]
    assert [line.split(":")[0] for line in near] == ["tasks/record/manifest.py"], near
    typed = subprocess.run(["git", "grep", "-n", "-E", r'extra="allow"|dict\[str, Any\]', "--", "tasks/record"],
                           cwd=ROOT, capture_output=True, text=True).stdout
    assert typed == "", typed


def test_lanes_of_many_threads_change_the_record_while_others_save(tmp_path: Path, monkeypatch) -> None:
    """Lanes of different hosts run in threads: new lanes, stages and correctness entries appear
    while another thread saves. The save holds the lock they take, so no dump meets a dict mid-change."""
    import threading

    monkeypatch.setenv("LANEBENCH_LEDGER_DIR", str(tmp_path / "ledger"))
    run = RunFolder(tmp_path, "nightly", "feedface-0000", ROOT / "hosts.yaml")
    errors: list[BaseException] = []

    def lane(i: int) -> None:
        try:
            for j in range(40):
                run.stage(f"lane{i}-{j}", "boot")
                run.correctness(f"lane{i}-{j}")
                with run.edit() as m:
                    m.flow.comparison_refused[f"lane{i}-{j}"] = "x"
        except BaseException as e:  # noqa: BLE001 - any error is the finding
            errors.append(e)

    threads = [threading.Thread(target=lane, args=(i,)) for i in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    m = read_manifest(run.path)
    assert len(m.lanes) == 240 and len(m.flow.correctness) == 240 and len(m.flow.comparison_refused) == 240


def test_a_lane_flag_is_a_finding_with_its_fix(tmp_path: Path) -> None:
    """A flag is typed (check, declared, effective, severity, message), not a dict each writer
    shapes: CI once failed on a flag built by hand as `dict[str, Any]`, and a hand-built flag missing
    its message would have shown in the report as a KeyError. Read back as a Finding; a flag
    without its message, or of an unknown severity, is refused naming the field."""
    from tasks.record.rows import Finding

    data = json.loads((_folder(V0, "*_nightly_0f1e2d3c") / "manifest.json").read_text())
    flag = {"check": "suspect", "declared": "tok_s@c1 in [270, 290]", "effective": "201.3", "severity": "flag",
            "message": "tok_s@c1 -28.4 %: suspect, not yet a regression; fix: re-run on a quiet host"}
    data["lanes"]["rehearsal"]["flags"] = [flag]
    (read,) = parse_manifest(json.dumps(data)).lanes["rehearsal"].flags
    assert isinstance(read, Finding) and read.message.endswith("quiet host")
    for broken, why in (({k: v for k, v in flag.items() if k != "message"}, "lanes.rehearsal.flags.0.message: Field required"),
                        (flag | {"severity": "warning"}, "lanes.rehearsal.flags.0.severity")):
        data["lanes"]["rehearsal"]["flags"] = [broken]
        with pytest.raises(ManifestError, match=re.escape(why)):
            parse_manifest(json.dumps(data))
