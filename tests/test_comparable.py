"""Comparable or refused (issue 24), the parts that need no server: run folders written by the real
RunFolder (GX-validated tables) and report.md rendered from them."""

from __future__ import annotations

import uuid
from pathlib import Path

from conftest import REPO
from tasks.report.report import render
from tasks.record.rows import DecodeRow
from tasks.record.run_folder import RunFolder


def _lane(run: RunFolder, name: str, model_sha: str, tok: dict[int, float], speculative: bool) -> None:
    record = run.lane(name)
    record.status = "passed"
    record.config = {"host": "localhost", "engine": "llamacpp",
                     **({"drafter": {"path": "d.gguf"}, "speculative": {"method": "draft-simple", "k": 4}}
                        if speculative else {})}
    record.models = [{"role": "model", "path": "t.gguf", "bytes": 1, "sha256": model_sha}]
    run.write_table(name, "decode", [DecodeRow(
        lane=name, concurrency=c, repeats=3, aggregate_tok_s=t, aggregate_tok_s_min=t * 0.98,
        aggregate_tok_s_max=t * 1.02, aggregate_spread_pct=4.0, per_user_tok_s=t / c, ttft_p50_s=0.1,
        ttft_p95_s=0.2, itl_p50_s=0.01, requests=24, failed_requests=0) for c, t in tok.items()])


def test_a_nightly_says_when_speculation_loses_to_the_plain_lane_of_the_same_target(tmp_path: Path):
    """The seeds' nightly: speculative 381/497 tok/s, plain 1418/1127 tok/s, both "passed" and no word."""
    run = RunFolder(tmp_path, "nightly", str(uuid.uuid4()), REPO / "hosts.yaml")
    _lane(run, "spec", "a" * 64, {1: 381.0, 2: 497.0}, speculative=True)
    _lane(run, "plain", "a" * 64, {1: 1418.0, 2: 1127.0, 4: 1500.0}, speculative=False)
    _lane(run, "other-target", "b" * 64, {1: 10.0}, speculative=False)  # another model: no comparison
    run.finish()
    text = render(run)
    assert "## Speculation against no speculation" in text
    assert "- **SPECULATION LOSES at C=1: spec 381.0 tok/s against 1418.0 tok/s for plain (plain, same target) (-73%)**" in text
    assert "SPECULATION LOSES at C=2: spec 497.0 tok/s against 1127.0 tok/s" in text
    assert "C=4" not in text.split("## Speculation against no speculation")[1].split("##")[0]  # not shared
    assert "other-target" not in text.split("## Speculation against no speculation")[1].split("##")[0]
    assert "verdict: **passed, FLAGGED** (spec: SPECULATION LOSES at C=1; spec: SPECULATION LOSES at C=2)" in text


def test_speculation_that_wins_and_a_lone_speculative_lane_are_both_said(tmp_path: Path):
    run = RunFolder(tmp_path, "nightly", str(uuid.uuid4()), REPO / "hosts.yaml")
    _lane(run, "spec", "a" * 64, {1: 30.0}, speculative=True)
    _lane(run, "plain", "a" * 64, {1: 20.0}, speculative=False)
    _lane(run, "lone", "c" * 64, {1: 20.0}, speculative=True)
    run.finish()
    text = render(run)
    assert "- speculation wins at C=1: spec 30.0 tok/s against 20.0 tok/s for plain (plain, same target) (+50%)" in text
    assert "no verdict on speculation for lone: no plain lane of the same target" in text
    assert "- verdict: **passed**" in text


def test_a_kl_reference_with_a_quantized_kv_cache_is_flagged():
    """The seeds' Q8_0 candidate failed (0.0254 mean |Δlogp|) against a reference served with a q8_0
    KV cache and called "f16, exact"; against a true f16 reference it read 0.0018."""
    from tasks.kl.suspicious import kl_flags, quantized_kv_cache

    assert quantized_kv_cache(["--cache-type-k", "q8_0"]) == "--cache-type-k q8_0"
    assert quantized_kv_cache(["-ctv=q4_0"]) == "-ctv q4_0" and quantized_kv_cache(["--kv-cache-dtype", "fp8"])
    assert quantized_kv_cache(["--cache-type-k", "f16", "-ctv", "bf16"]) is None
    lanes = {"ref": {"path": "target-f16.gguf", "sha256": "a" * 64, "context": 512, "flags": ["-ctk", "q8_0"]},
             "cand": {"path": "target-q8_0.gguf", "sha256": "b" * 64, "context": 512, "flags": []}}
    flags = kl_flags("ref", lanes)
    assert len(flags) == 1 and "quantized KV cache (-ctk q8_0)" in flags[0] and "fix:" in flags[0]
    lanes["ref"]["flags"] = []
    assert kl_flags("ref", lanes) == []  # the candidate's own cache type is the variable under test


def test_decode_rows_state_their_sample_size_and_ttft_dominated_rows_are_flagged():
    """Repeats 1 published "spread 0.0 %"; max_tokens 4 published 604 tok/s per user."""
    import pandas as pd

    from tasks.inventory.models import Lane
    from tasks.report.report import decode_table
    from tasks.stages.safety import noise_findings
    from conftest import shipped_inventory

    rows = [DecodeRow(lane="l", concurrency=c, repeats=1, aggregate_tok_s=600.0, aggregate_tok_s_min=600.0,
                      aggregate_tok_s_max=600.0, aggregate_spread_pct=0.0, per_user_tok_s=604.0, ttft_p50_s=0.2,
                      ttft_p95_s=0.3, itl_p50_s=0.002, requests=n, failed_requests=0, ttft_share_p50=share)
            for c, n, share in ((1, 4, 0.8), (2, 24, 0.3))]
    table = decode_table(pd.DataFrame([r.model_dump() for r in rows]))
    assert list(table["spread %"]) == ["n/a (1 repeat)"] * 2
    assert list(table["TTFT p95 s"]) == ["0.3 (n=4, TOO FEW)", "0.3"]
    assert list(table["TTFT share"]) == ["80% TTFT-DOMINATED", "30%"]
    lane = Lane.model_validate(shipped_inventory()["lanes"]["rehearsal"])
    found = {f.check: f for f in noise_findings(lane, rows, [])}
    assert set(found) == {"one repeat", "ttft dominates"}
    assert "C=1 (80% of e2el)" in found["ttft dominates"].message and "C=2" not in found["ttft dominates"].message
    steady = [r.model_copy(update={"repeats": 3, "ttft_share_p50": 0.1}) for r in rows]
    assert noise_findings(lane, steady, []) == []


def test_a_matrix_arm_may_differ_from_no_speculation_only_in_speculation():
    from tasks.record.fingerprint import beyond_speculation, describe_differences

    plain = {"model.sha256": "a" * 64, "drafter.sha256": "none", "launch": "llama-server -m x", "server.max_running_requests": "8",
             "bench.decode.max_tokens": "64", "host.cores": "2"}
    arm = plain | {"drafter.sha256": "d" * 64, "launch": "llama-server -m x -md d --spec-type draft-simple",
                   "server.speculative_type": "'draft-simple'", "server.draft_model": "'sha256:dd'",
                   "bench.acceptance.max_tokens": "96"}
    assert beyond_speculation(arm, plain) == []  # speculation is the variable under test
    other = arm | {"model.sha256": "b" * 64, "server.max_running_requests": "4"}
    diffs = beyond_speculation(other, plain)
    assert [d[0] for d in diffs] == ["model.sha256", "server.max_running_requests"]
    assert describe_differences(diffs) == f"model.sha256: {'a' * 16}... -> {'b' * 16}...; server.max_running_requests: 8 -> 4"
