"""Comparable or refused (issue 24), the parts that need no server: run folders written by the real
RunFolder (GX-validated tables) and report.md rendered from them."""

from __future__ import annotations

import uuid
from pathlib import Path

from conftest import REPO
from tasks.record.report import render
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
