"""Safe by default on a real llama-server: lanes written as a new user writes them (no gate
declared), each built to trip one of the field reports' mistakes. Two nightlies, four lanes:
each lane ends failed or flagged with declared value, effective value and fix; none passes silently.
"""

from __future__ import annotations

import os

import pandas as pd
import pytest

from conftest import manifest_of, no_llama_server_left, run_cli, run_folder_of, shipped_inventory, write_inventory

PORTS = range(18470, 18474)


def _new_user_lane(port: int, **changes) -> dict:
    """The rehearsal lane as a new user copies it: no gates, short bench, no correctness suites."""
    lane = shipped_inventory()["lanes"]["rehearsal"]
    for key in ("gates", "agentic", "correctness"):
        lane.pop(key)
    lane["port"] = port
    lane["bench"] = {"repeats": 1,
                     "decode": {"concurrency": [1], "max_tokens": 16, "requests_per_stream": 1,
                                "prompts": "testbed/prompts/prose.jsonl"},
                     "acceptance": {"max_tokens": 48, "prompts_per_class": 3,
                                    "classes": {"prose": "testbed/prompts/prose.jsonl"}}}
    lane.update(changes)
    return lane


@pytest.fixture(scope="module")
def failing(tmp_path_factory, llama_bin):
    """A drafter with no speculative type and a bench above the slots; synthetic acceptance on a
    binary outside the pinned build."""
    folder = tmp_path_factory.mktemp("failing")
    wrapper = folder / "my-llama-server"
    wrapper.write_text(f"#!/bin/sh\nexec {llama_bin / 'llama-server'} \"$@\"\n")
    os.chmod(wrapper, 0o755)
    inv = shipped_inventory()
    never = _new_user_lane(PORTS[0], speculative=None, flags=[], slots=4)
    never["bench"]["decode"]["concurrency"] = [1, 8]
    synthetic = _new_user_lane(PORTS[1], binary=str(wrapper),
                               flags=["--spec-draft-n-min", "0", "--spec-draft-p-min", "0.0", "--spec-synth-len", "4.5"])
    inv["lanes"] = {"drafter-never-runs": never, "synthetic": synthetic}
    result = run_cli("nightly", "--hosts", str(write_inventory(folder, inv)), "--artifacts", str(folder / "artifacts"))
    return result, run_folder_of(result)


@pytest.fixture(scope="module")
def flagged(tmp_path_factory, llama_bin):
    """The target as its own drafter (context above what the model serves, a tiny probe set, a
    spread bound no two repeats meet), and a weak drafter behind a draft probability floor."""
    folder = tmp_path_factory.mktemp("flagged")
    inv = shipped_inventory()
    itself = _new_user_lane(PORTS[2], drafter={"path": "testbed/models/target-f16.gguf"}, context=2048, slots=2)
    itself["bench"]["repeats"] = 2
    itself["bench"]["unstable_spread_pct"] = 0.001
    floor = _new_user_lane(PORTS[3], drafter={"path": "testbed/models/drafter-weak-f16.gguf"},
                           flags=["--spec-draft-n-min", "0", "--spec-draft-p-min", "0.3"])
    floor["bench"]["acceptance"]["prompts_per_class"] = 8
    inv["lanes"] = {"target-drafts-itself": itself, "draft-floor": floor}
    result = run_cli("nightly", "--hosts", str(write_inventory(folder, inv)), "--artifacts", str(folder / "artifacts"))
    return result, run_folder_of(result)


def _gates(lane: dict) -> dict:
    return {g["gate"]: g for g in lane["gates"]}


def test_a_drafter_without_speculation_and_a_bench_above_the_slots_fail_undeclared(failing):
    result, folder = failing
    assert result.returncode == 1, result.stdout + result.stderr
    lane = manifest_of(folder)["lanes"]["drafter-never-runs"]
    stages = [t["stage"] for t in lane.get("timeline", [])] or [lane["stage"]]
    assert lane["status"] == "failed" and "boot gates" in stages and "warmup" not in stages
    gates = _gates(lane)
    drafts, capacity = gates["drafts-happen (implied)"], gates["capacity (implied)"]
    assert not drafts["passed"] and "llamacpp:spec_decode_num_drafts_total" in drafts["detail"]
    assert "declared drafter drafter-good-f16.gguf, effective drafts over the probe: 0" in drafts["detail"]
    assert "fix: declare speculative" in drafts["detail"]
    assert not capacity["passed"] and "declared bench concurrency up to 8 (slots 4), effective running-request cap 4" \
        in capacity["detail"] and "fix:" in capacity["detail"]
    assert "drafts-happen (implied)" in lane["reason"]
    assert not (folder / "drafter-never-runs" / "decode.parquet").exists()
    assert no_llama_server_left(PORTS)


def test_synthetic_acceptance_fails_and_a_binary_outside_the_pin_is_recorded(failing):
    _, folder = failing
    lane = manifest_of(folder)["lanes"]["synthetic"]
    assert lane["status"] == "failed"
    synth = _gates(lane)["synthetic (implied)"]
    assert not synth["passed"] and "generated output is not valid" in synth["detail"]
    assert "fix: remove --spec-synth-len" in synth["detail"]
    (binary,) = [f for f in lane["flags"] if f["check"] == "engine binary"]
    assert "my-llama-server" in binary["effective"] and binary["declared"].startswith("llama-cpp-python==")
    assert "outside the pinned build" in binary["message"]
    report = (folder / "report.md").read_text()
    assert "**FLAG** engine binary" in report and "synthetic (implied)" in report


def test_the_target_as_its_own_drafter_is_flagged_not_celebrated(flagged):
    result, folder = flagged
    assert result.returncode == 0, result.stdout + result.stderr
    out = result.stdout + result.stderr
    assert "FLAGGED" in out  # passed, never silently
    lane = manifest_of(folder)["lanes"]["target-drafts-itself"]
    checks = {f["check"]: f for f in lane["flags"]}
    assert {"drafter is the target", "acceptance near K+1", "probe set too small", "context", "unstable"} <= set(checks)
    assert checks["context"]["declared"] == 2048 and checks["context"]["effective"] == 1024  # the model trained to 1024
    assert "re-run on a quiet host" in checks["unstable"]["message"]
    acc = pd.read_parquet(folder / "target-drafts-itself" / "acceptance.parquet").iloc[0]
    # Every draft accepted; the budget-cut last draft of each request kept apart.
    assert acc.acceptance_length < 5.0 and acc.acceptance_length_full_steps == pytest.approx(5.0)
    assert acc.budget_cut_steps >= 1 and not acc.enough_prompts
    decode = pd.read_parquet(folder / "target-drafts-itself" / "decode.parquet")
    assert decode.unstable.all() and decode.busy_pct.notna().all()
    report = (folder / "report.md").read_text()
    assert "passed, FLAGGED" in report and "UNSTABLE" in report and "(too few: no verdict)" in report
    assert no_llama_server_left(PORTS)


def test_a_draft_floor_is_reported_in_tokens_per_target_pass(flagged):
    _, folder = flagged
    lane = manifest_of(folder)["lanes"]["draft-floor"]
    acc = pd.read_parquet(folder / "draft-floor" / "acceptance.parquet").iloc[0]
    assert acc.tokens_per_pass < acc.acceptance_length and acc.drafted_share < 0.8
    (skipped,) = [f for f in lane["flags"] if f["check"] == "drafts skipped"]
    assert "--spec-draft-p-min" in skipped["message"] and "tokens per forward pass" in skipped["message"]
    raw = pd.read_json(folder / "draft-floor" / "requests.jsonl", lines=True)
    assert set(raw.truncation) <= {"none", "max_tokens"}
