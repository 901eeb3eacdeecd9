"""The rehearsal lane end to end from the CLI, as a new user runs it, on a real llama-server."""

from __future__ import annotations

import hashlib
import json
import re

import pandas as pd
import pytest

from conftest import (manifest_of, no_llama_server_left, run_cli, run_folder_of, shipped_inventory,
                      write_inventory)


@pytest.fixture(scope="module")
def nightly_run(tmp_path_factory, llama_bin):
    """`lanebench nightly` with no configuration: the shipped rehearsal lane."""
    artifacts = tmp_path_factory.mktemp("artifacts")
    result = run_cli("nightly", "--artifacts", str(artifacts))
    return result, run_folder_of(result)


def test_nightly_passes_and_names_its_run_folder(nightly_run):
    result, folder = nightly_run
    assert result.returncode == 0, result.stdout + result.stderr
    assert folder.is_dir() and folder.name.split("_")[1] == "nightly"
    assert no_llama_server_left()


def test_manifest_records_what_ran(nightly_run):
    _, folder = nightly_run
    m = manifest_of(folder)
    assert len(m["lanebench"]["git_sha"]) == 40
    assert m["flow"]["flow_run_id"].startswith(folder.name.rsplit("_", 1)[1])
    lane = m["lanes"]["rehearsal"]
    assert lane["status"] == "passed", lane
    assert "--spec-type draft-simple" in lane["launch_command"] and "--model-draft" in lane["launch_command"]
    # `gpus: 0`: target and drafter stay on the CPU whatever the build (a CUDA one offloads all by default)
    assert lane["launch_command"].endswith("--n-gpu-layers 0 --n-gpu-layers-draft 0") and not any(lane["gpu"].values())  # no nvidia-smi: no GPU fact recorded
    assert lane["engine_identity"]["source"].startswith("llama-cpp-python==0.3.36")
    assert {x["role"] for x in lane["models"]} == {"model", "drafter"}
    assert all(len(x["sha256"]) == 64 and x["bytes"] > 0 for x in lane["models"])
    assert lane["boot_facts"]["max_running_requests"] == 8
    assert lane["boot_facts"]["context_per_slot"] == 512
    assert lane["boot_facts"]["draft_model_loaded"] is True
    assert lane["boot_facts"]["speculative_type"] == "draft-simple"
    assert [g["passed"] for g in lane["gates"]] == [True, True, True]
    assert lane["gates"][2]["gate"] == "draft-width (implied)"  # the declared K, checked on the server's counters
    # Safe by default: the shipped lane on an idle machine raises no flag (a busy one may flag noise).
    assert not [f for f in lane["flags"] if f["check"] not in ("unstable", "warmup noise")], lane["flags"]


def test_every_artifact_hash_matches_and_validated(nightly_run):
    _, folder = nightly_run
    m = manifest_of(folder)
    kinds = {a["kind"]: a for a in m["artifacts"]}
    assert {"warmup", "decode", "acceptance", "requests", "boot-log", "report"} <= set(kinds)
    for a in m["artifacts"]:
        assert hashlib.sha256((folder / a["path"]).read_bytes()).hexdigest() == a["sha256"], a["path"]
    for kind in ("warmup", "decode", "acceptance", "requests"):
        assert kinds[kind]["validation"] == "passed", kinds[kind]


def test_measurement_rules_hold(nightly_run):
    _, folder = nightly_run
    raw = pd.read_json(folder / "rehearsal" / "requests.jsonl", lines=True)
    # Warmup waves are recorded apart from the measured ones; every shape got one.
    warm = raw[raw.stage == "warmup"]
    assert set(warm.concurrency) == {1, 2, 4, 8}
    assert set(warm.prompt_class) >= {"prose", "code", "math", "tool"}
    # Three measured repeats at each level; every prompt carries its own nonce.
    decode = raw[raw.stage == "decode"]
    assert set(decode.repeat) == {1, 2, 3}
    assert raw.nonce.is_unique
    table = pd.read_parquet(folder / "rehearsal" / "decode.parquet")
    assert list(table.concurrency) == [1, 2, 4, 8] and (table.repeats == 3).all()
    # bench.decode.requests_per_level: every level's TTFT p95 stands on at least 20 requests, so
    # the regression check judges it at C=1 too (not "too few samples").
    assert ((table.requests - table.failed_requests) >= 20).all(), table[["concurrency", "requests"]]
    assert decode.groupby("concurrency").size().to_dict() == {1: 24, 2: 24, 4: 24, 8: 48}
    assert (table.aggregate_tok_s_min <= table.aggregate_tok_s).all()
    acc = pd.read_parquet(folder / "rehearsal" / "acceptance.parquet")
    assert set(acc.prompt_class) == {"prose", "code", "math", "tool"}
    assert ((acc.acceptance_length > 1.0) & (acc.acceptance_length <= 5.0)).all()
    for curve in acc.per_position:
        assert all(a >= b for a, b in zip(curve, curve[1:]))


def test_report_shows_the_tables(nightly_run):
    _, folder = nightly_run
    report = (folder / "report.md").read_text()
    for heading in ("## Lanes", "### Warmup", "### Decode curve", "### Speculative acceptance"):
        assert heading in report
    # Passed; a flag here may only be the host's noise (a box shared with other work), never a
    # declared-vs-effective mismatch on the shipped lane.
    assert re.search(r"\| rehearsal \| \*\*passed\*\*( \(\d+ flagged\))? \|", report), report[:1500]
    flags = json.loads((folder / "manifest.json").read_text())["lanes"]["rehearsal"]["flags"]
    assert {f["check"] for f in flags} <= {"warmup noise", "unstable"}, flags


def _lane_variant(tmp_path, **changes) -> tuple:
    inv = shipped_inventory()
    lane = inv["lanes"]["rehearsal"]
    for key, value in changes.items():
        if value is None:
            lane.pop(key, None)
        else:
            lane[key] = value
    lane["bench"]["repeats"] = 1
    for bench in ("prefill", "accuracy"):  # not what these tests look at (tests/test_benches.py does)
        lane["bench"].pop(bench, None)
    return write_inventory(tmp_path, inv), tmp_path / "artifacts"


def test_counter_gate_fails_a_drafter_loaded_without_speculation(tmp_path, llama_bin):
    hosts, artifacts = _lane_variant(tmp_path, speculative=None,
                                     flags=[])  # draft model loaded, --spec-type never passed
    result = run_cli("nightly", "--hosts", str(hosts), "--artifacts", str(artifacts))
    assert result.returncode == 1, result.stdout + result.stderr
    lane = manifest_of(run_folder_of(result))["lanes"]["rehearsal"]
    assert lane["status"] == "failed" and lane["stage"] == "boot gates"
    assert "drafts-happen" in lane["reason"] and "llamacpp:spec_decode_num_drafts_total" in lane["reason"]
    assert "= 0, required > 0" in lane["reason"]
    assert lane["boot_facts"]["draft_model_loaded"] is True
    assert "--model-draft" in lane["launch_command"] and "--spec-type" not in lane["launch_command"]
    folder = run_folder_of(result)
    assert not (folder / "rehearsal" / "decode.parquet").exists()  # measurements stopped
    assert "drafts-happen" in result.stdout + result.stderr
    assert no_llama_server_left()


def test_capacity_gate_fails_bench_concurrency_above_server_slots(tmp_path, llama_bin):
    hosts, artifacts = _lane_variant(tmp_path, slots=4)  # bench still asks for 8 concurrent requests
    result = run_cli("nightly", "--hosts", str(hosts), "--artifacts", str(artifacts))
    assert result.returncode == 1, result.stdout + result.stderr
    lane = manifest_of(run_folder_of(result))["lanes"]["rehearsal"]
    assert lane["status"] == "failed" and "capacity" in lane["reason"]
    assert "= 4, required >= 8" in lane["reason"]
    assert no_llama_server_left()


def test_missing_model_skips_lane_with_reason_and_others_run(tmp_path, llama_bin):
    inv = shipped_inventory()
    good = inv["lanes"]["rehearsal"]
    good["bench"]["repeats"] = 1
    good["bench"]["decode"]["concurrency"] = [1]
    good["bench"].pop("acceptance")
    for bench in ("prefill", "accuracy"):
        good["bench"].pop(bench, None)
    broken = {**good, "port": 18081, "model": {"path": "testbed/models/absent.gguf"}}
    inv["lanes"] = {"broken": broken, "rehearsal": good}
    hosts = write_inventory(tmp_path, inv)
    result = run_cli("nightly", "--hosts", str(hosts), "--artifacts", str(tmp_path / "artifacts"))
    assert result.returncode == 0, result.stdout + result.stderr
    m = manifest_of(run_folder_of(result))
    assert m["lanes"]["broken"]["status"] == "skipped" and "absent.gguf is missing" in m["lanes"]["broken"]["reason"]
    assert m["lanes"]["rehearsal"]["status"] == "passed"
    assert "absent.gguf is missing" in (run_folder_of(result) / "report.md").read_text()


def test_failed_expectations_quarantine_results_and_fail_the_run(tmp_path, llama_bin):
    """A context too small for the bench: short prompts are cut short of max_tokens (the server
    says stop_type=limit), long ones are refused. Neither may count as a result."""
    # Only the expectations are under test: the agentic smoke would refuse this context first.
    hosts, artifacts = _lane_variant(tmp_path, context=256, agentic=None, correctness=None)
    inv_lane = shipped_inventory()["lanes"]["rehearsal"]
    assert inv_lane["bench"]["decode"]["max_tokens"] == 64
    result = run_cli("nightly", "--hosts", str(hosts), "--artifacts", str(artifacts))
    assert result.returncode == 1, result.stdout + result.stderr
    folder = run_folder_of(result)
    m = manifest_of(folder)
    lane = m["lanes"]["rehearsal"]
    assert lane["status"] == "failed" and "expectations failed" in lane["reason"]
    decode = next(a for a in m["artifacts"] if a["kind"] == "decode")
    assert decode["validation"] == "failed" and decode["path"] == "rehearsal/quarantine/decode.parquet"
    assert any("failed_requests" in f for f in decode["failed_expectations"])
    raw = next(a for a in m["artifacts"] if a["kind"] == "requests")
    assert raw["validation"] == "failed"
    assert any("output_tokens" in f and "max_tokens" in f for f in raw["failed_expectations"])  # cut short
    assert any("ok" in f or "error" in f for f in raw["failed_expectations"])  # refused
    assert not (folder / "rehearsal" / "decode.parquet").exists()
    assert (folder / "rehearsal" / "requests.jsonl").exists()  # every raw record is kept
    report = (folder / "report.md").read_text()
    assert "QUARANTINED" in report and "failed_requests" in report


def test_verify_catches_a_changed_byte_a_missing_and_an_extra_file(nightly_run, tmp_path):
    import shutil

    _, folder = nightly_run
    copy = tmp_path / folder.name
    shutil.copytree(folder, copy)
    ok = run_cli("verify", str(copy))
    assert ok.returncode == 0 and ok.stdout.startswith("ok:"), ok.stdout
    target = copy / "rehearsal" / "decode.parquet"
    data = bytearray(target.read_bytes())
    data[len(data) // 2] ^= 0x01
    target.write_bytes(bytes(data))
    (copy / "rehearsal" / "boot.log").unlink()
    (copy / "rehearsal" / "notes.txt").write_text("added later")
    bad = run_cli("verify", str(copy))
    assert bad.returncode == 1
    assert "changed: rehearsal/decode.parquet" in bad.stdout
    assert "missing: rehearsal/boot.log" in bad.stdout
    assert "extra: rehearsal/notes.txt" in bad.stdout
