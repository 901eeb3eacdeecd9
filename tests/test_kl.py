"""The KL gate: the rehearsal from the CLI on real llama-servers, its agreement with
llama.cpp's own `llama-perplexity --kl-divergence`, its refusals, and the adapters' parsers.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import yaml
from conftest import REPO, interrupt_cli, llama_server_pid, manifest_of, no_llama_server_left, run_cli, run_folder_of

TARGET = REPO / "testbed" / "models" / "target-f16.gguf"
PROMPTS = REPO / "kl" / "prompts.jsonl"
FIXTURES = REPO / "tests" / "fixtures" / "engines"


def kl_file(folder: Path, name: str, lanes: dict, candidates: list[str], **extra) -> Path:
    """A KL file with absolute paths (testbed target as reference unless `lanes` says otherwise)."""
    data = {"prompts": str(PROMPTS), "reference": "f16", "candidates": candidates, "lanes": lanes,
            "bars": {"max_mean_abs_dlogprob": 0.05, "max_argmax_flip_share": 0.05}}
    data.update(extra)
    path = folder / name
    path.write_text(yaml.safe_dump(data))
    return path


def llama_lane(port: int, **extra) -> dict:
    return {"engine": "llamacpp", "model": {"path": str(TARGET)}, "port": port, "threads": 1, "context": 512, **extra}


def tables(folder: Path) -> tuple[pd.DataFrame, pd.DataFrame]:
    pairs = folder / "gate" / "kl_pairs.parquet"
    return (pd.read_parquet(folder / "gate" / "kl_summary.parquet").set_index("lane"),
            pd.read_parquet(pairs) if pairs.exists() else pd.DataFrame())


# --- the rehearsal, as a user runs it ------------------------------------------------------


@pytest.fixture(scope="module")
def rehearsal(tmp_path_factory, llama_bin):
    """`lanebench kl kl/rehearsal.yaml`: all 40 prompts x 128 tokens (about 80 s on 2 idle cores)."""
    artifacts = tmp_path_factory.mktemp("artifacts")
    t0 = time.monotonic()
    result = run_cli("kl", "kl/rehearsal.yaml", "--artifacts", str(artifacts))
    print(f"rehearsal KL run: {time.monotonic() - t0:.1f} s")
    return result, run_folder_of(result)


def test_rehearsal_passes_and_tears_down(rehearsal):
    result, folder = rehearsal
    assert result.returncode == 0, result.stdout + result.stderr
    assert folder.name.split("_")[1] == "kl"
    assert no_llama_server_left(range(18210, 18213))


def test_q8_is_closer_than_q4_and_the_instrument_is_exact(rehearsal):
    _, folder = rehearsal
    summary, pairs = tables(folder)
    ref, q8, q4 = summary.loc["f16"], summary.loc["q8_0"], summary.loc["q4_0"]
    # Exactness: the reference's two scorings of its own text are identical, to the bit.
    assert ref.verdict == "exact" and ref.max_abs_dlogprob == 0.0 and ref.positions == 40 * 128
    assert q8.mean_abs_dlogprob < q4.mean_abs_dlogprob
    assert q8.argmax_flip_share < q4.argmax_flip_share
    assert (summary.loc[["q8_0", "q4_0"], "positions"] == ref.positions).all()
    pair = pairs.set_index(["lane_a", "lane_b"]).loc[("q8_0", "q4_0")]
    assert pair.resamples >= 2000
    # The paired bootstrap CI on the per-prompt gap (Q8 minus Q4) lies below zero.
    assert pair.gap_ci_low <= pair.gap_mean_abs_dlogprob <= pair.gap_ci_high < 0
    assert bool(pair.gap_ci_excludes_zero)
    print(f"q8_0: mean {q8.mean_abs_dlogprob:.4f} flips {q8.argmax_flip_share:.4f}; "
          f"q4_0: mean {q4.mean_abs_dlogprob:.4f} flips {q4.argmax_flip_share:.4f}; "
          f"gap CI [{pair.gap_ci_low:.4f}, {pair.gap_ci_high:.4f}]")


def test_run_folder_is_complete_and_validated(rehearsal):
    _, folder = rehearsal
    m = manifest_of(folder)
    for a in m["artifacts"]:
        assert hashlib.sha256((folder / a["path"]).read_bytes()).hexdigest() == a["sha256"], a["path"]
    kinds = [(a["kind"], a["validation"]) for a in m["artifacts"] if a["kind"].startswith("kl_")]
    assert sorted(k for k, _ in kinds) == ["kl_pairs", "kl_positions", "kl_positions", "kl_positions", "kl_summary"]
    assert all(v == "passed" for _, v in kinds), kinds
    for lane in ("f16", "q8_0", "q4_0"):
        record = m["lanes"][lane]
        # Speculation off, whatever the lane: no drafter, no speculative type.
        assert "--model-draft" not in record["launch_command"] and "--spec" not in record["launch_command"]
    assert m["lanes"]["q4_0"]["config"]["model"]["path"].endswith("-Q4_0.gguf")
    assert m["flow"]["kl"]["exactness"]["exact"] is True
    report = (folder / "report.md").read_text()
    assert "**PASS**" in report and "| q8_0 vs q4_0 |" in report and "(excludes 0)" in report
    assert (folder / "gate" / "kl_hist.png").read_bytes()[:4] == b"\x89PNG"


def _text_of(ids: list[int]) -> bytes | None:
    """Testbed vocabulary: ids 3..258 are bytes 0..255, 259 is the space piece; None for control tokens."""
    out = bytearray()
    for t in ids:
        if 3 <= t <= 258:
            out.append(t - 3)
        elif t == 259:
            out += b" "
        else:
            return None
    return bytes(out)


def test_argmax_flips_agree_with_llama_perplexity(rehearsal, llama_bin, tmp_path):
    """Our argmax-flip share against llama.cpp's own "Same top p", on the same models and text.

    What is compared: llama-perplexity splits its input into chunks of `-c` tokens, puts BOS
    first in each, and scores positions c/2 .. c-2 (logits at j predict token j+1). Every
    shipped prompt is 128 ASCII bytes, i.e. BOS + 128 tokens on the testbed vocabulary, so a
    sample with a full 128-token continuation is exactly 257 tokens: with `-c 257` each chunk
    is one KL sequence (context + the reference's greedy tokens), and the positions
    llama-perplexity scores are exactly our 128 continuation positions. Its "Same top p" is the
    share where the candidate's argmax equals the F16 base's argmax; ours, `flip`, is the share
    where the candidate's argmax differs from the reference's greedy token (= the F16 argmax).
    Samples whose continuation stopped early or holds a control token cannot be written as text
    and are left out of both. The numbers differ only where batched prefill (llama-perplexity)
    and one-token-at-a-time scoring (the server probes) round differently near a tie.
    """
    _, folder = rehearsal
    seqs = [json.loads(line) for line in (folder / "f16" / "reference.jsonl").read_text().splitlines()]
    keep = [s for s in seqs if len(s["continuation"]) == 128 and len(s["context"]) == 129
            and s["context"][0] == 1 and _text_of(s["context"][1:] + s["continuation"]) is not None]
    assert len(keep) >= 20, f"only {len(keep)} of {len(seqs)} sequences can be written as text"
    # The first chunk's BOS comes from tokenization; each later chunk's first token ("\n") is replaced by BOS.
    text = tmp_path / "kl-text.txt"
    text.write_bytes(b"\n".join(_text_of(s["context"][1:] + s["continuation"]) for s in keep))
    models = {n: manifest_of(folder)["lanes"][n]["config"]["model"]["path"] for n in ("f16", "q8_0", "q4_0")}
    base = tmp_path / "f16.kld"
    # One compute thread: on 2 cores, two compute threads left the logger's worker thread starved
    # for whole runs (every row and the summary lost, 3 runs of 3, in a fresh clone at 16:50 UTC).
    common = ["-f", str(text), "-c", "257", "-b", "257", "-t", "1", "--no-warmup", "--kl-divergence-base", str(base)]

    def perplexity(model: str, *more: str, last: str) -> re.Match:
        """Run llama-perplexity; the match of `last`, a line it prints at its very end.

        llama-perplexity prints through llama.cpp's asynchronous logger (common/log.cpp): LOG()
        queues the line and a worker thread writes it. The logger is a deliberately leaked
        singleton, never paused or joined, and main() returns without a flush, so whatever is
        still queued at exit is lost, with exit code 0. The summary (its last ~45 lines,
        "Same top p" among them) is queued in the final millisecond before exit; on a loaded
        2-core machine the worker is often not scheduled in time (seen in 2 of 30 runs under
        load, 4 of 8 under strace; with two compute threads, once in 3 runs of 3). A run whose output lacks its last line is therefore run
        again, up to 3 times in all; a run that never completes still fails, with its tails.
        """
        tails = []
        for _ in range(3):
            p = subprocess.run([str(llama_bin / "llama-perplexity"), "-m", model, *common, *more],
                               check=False, capture_output=True, text=True, timeout=300)
            assert p.returncode == 0, p.stderr[-2000:]
            out = p.stdout + p.stderr
            if match := re.search(last, out):
                return match
            tails.append(out[-1500:])
        raise AssertionError(f"llama-perplexity {Path(model).name} {' '.join(more)}: no {last!r} in 3 runs; "
                             "output tails:\n" + "\n-----\n".join(tails))

    # Its last line in plain perplexity mode; the base file is complete once the run got there.
    out = perplexity(models["f16"], last=r"Final estimate: PPL = [\d.]+").string
    assert f"over {len(keep)} chunks, n_ctx=257" in out  # the text tokenized to exactly the KL sequences
    ids = {s["prompt_id"] for s in keep}
    for lane in ("q8_0", "q4_0"):
        # Always a number: positions = 128 per chunk >= 100, so llama-perplexity prints the summary.
        same_top = float(perplexity(models[lane], "--kl-divergence", last=r"Same top p:\s+([\d.]+) ±")[1]) / 100
        pos = pd.read_parquet(folder / lane / "kl_positions.parquet")
        ours = pos[pos.prompt_id.isin(ids)]
        assert len(ours) == 128 * len(keep)
        print(f"{lane}: llama-perplexity argmax != base {1 - same_top:.4f}, lanebench flips {ours.flip.mean():.4f}")
        assert abs((1 - same_top) - ours.flip.mean()) <= 0.02


# --- refusals and partial results ------------------------------------------------------------


def test_a_different_tokenizer_is_refused(tmp_path, llama_bin):
    """Same weights, but the candidate's server tokenizes with a space prefix: a real tokenizer difference."""
    path = kl_file(tmp_path, "tok.yaml", candidates=["spm_prefix"], lanes={
        "f16": llama_lane(18221),
        "spm_prefix": llama_lane(18222, flags=["--override-kv", "tokenizer.ggml.add_space_prefix=bool:true"])})
    result = run_cli("kl", str(path), "--artifacts", str(tmp_path / "art"), "--prompt-count", "2")
    folder = run_folder_of(result)
    assert result.returncode == 1, result.stdout + result.stderr
    summary, _ = tables(folder)
    row = summary.loc["spm_prefix"]
    assert row.status == "refused" and row.positions == 0 and row.verdict == "fail"
    assert "tokenizer differs" in row.reason and "first difference at token" in row.reason
    assert "tokenizer differs" in result.stderr  # the failure line, before the run folder
    assert no_llama_server_left(range(18221, 18223))


def test_an_inexact_instrument_refuses_to_judge(tmp_path, llama_bin):
    """A real source of inexactness: prompts scored concurrently on a multi-slot llama-server.

    llama.cpp's CPU kernels are not batch-invariant: a position computed in a batch with
    another sequence's tokens rounds differently from the same position computed alone, and
    which requests share a batch depends on timing. (This is the GPU engines' well-known
    failure mode too.) So the reference's two scorings of its own text differ, the gate says
    so, and no candidate is even booted.
    """
    path = kl_file(tmp_path, "conc.yaml", candidates=["other"], concurrency=3,
                   lanes={"f16": llama_lane(18231, threads=2), "other": llama_lane(18232)})
    result = run_cli("kl", str(path), "--artifacts", str(tmp_path / "art"), "--prompt-count", "6")
    folder = run_folder_of(result)
    assert result.returncode == 1, result.stdout + result.stderr
    assert "instrument not exact" in result.stderr
    summary, _ = tables(folder)
    assert summary.loc["f16", "verdict"] == "inexact" and summary.loc["f16", "max_abs_dlogprob"] > 1e-6
    assert summary.loc["other", "verdict"] == "no verdict" and summary.loc["other", "positions"] == 0
    assert not (folder / "other" / "boot.log").exists()
    assert "NO VERDICT" in (folder / "report.md").read_text()
    assert manifest_of(folder)["flow"]["kl"]["exactness"]["exact"] is False


def test_a_candidate_that_dies_keeps_its_partial_results(tmp_path, llama_bin):
    """The candidate's server is killed (SIGKILL) once it has scored a prompt; what it scored stays, marked."""
    path = kl_file(tmp_path, "die.yaml", candidates=["q8_0"], lanes={
        "f16": llama_lane(18241), "q8_0": llama_lane(18242, quantize={"type": "Q8_0"})})
    artifacts = tmp_path / "art"
    cli = subprocess.Popen([sys.executable, "-m", "flows.cli", "kl", str(path), "--artifacts", str(artifacts),
                            "--prompt-count", "12"], cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    killed = None
    try:
        deadline = time.monotonic() + 240
        while killed is None and time.monotonic() < deadline and cli.poll() is None:
            scores = list(artifacts.glob("*_kl_*/q8_0/scores.jsonl"))
            if scores and scores[0].read_text().count("\n") >= 1 and (pid := llama_server_pid(18242)):
                os.kill(pid, signal.SIGKILL)
                killed = pid
            time.sleep(0.02)
        out, err = cli.communicate(timeout=300)
    finally:
        if cli.poll() is None:
            cli.kill()
    assert killed is not None, "the candidate finished before it could be killed"
    assert cli.returncode == 1, out + err
    folder = Path(out.strip().splitlines()[-1].removeprefix("run folder: "))
    summary, _ = tables(folder)
    row = summary.loc["q8_0"]
    assert row.status == "partial" and row.verdict == "fail" and "died mid-scoring" in row.reason
    assert 0 < row.positions < row.positions_expected
    kept = pd.read_parquet(folder / "q8_0" / "kl_positions.parquet")
    assert len(kept) == row.positions
    assert manifest_of(folder)["lanes"]["q8_0"]["warnings"]
    assert no_llama_server_left(range(18241, 18243))


@pytest.mark.parametrize("sig, ports", [("SIGINT", (18244, 18245)), ("SIGTERM", (18246, 18247))])
def test_ctrl_c_mid_reference_stops_kl_like_nightly(tmp_path, llama_bin, sig, ports):
    """Ctrl-C to `lanebench kl`'s process group, or SIGTERM to the process alone, while the
    reference scores (flows/cli/__init__.py -> run_flow): exit 130 naming the signal, the reference's
    server torn down, the run folder marked interrupted with what was scored kept, verify
    passes, no verdict."""
    reference, candidate = ports
    path = kl_file(tmp_path, "stop.yaml", candidates=["q8_0"], lanes={
        "f16": llama_lane(reference), "q8_0": llama_lane(candidate, quantize={"type": "Q8_0"})})
    artifacts = tmp_path / "art"
    result, sent = interrupt_cli("kl", str(path), "--artifacts", str(artifacts), "--prompt-count", "12",
                                 when=lambda: any(artifacts.glob("*_kl_*/f16/*.jsonl")) and llama_server_pid(reference),
                                 signal_name=sig)
    out, err = result.stdout, result.stderr
    assert sent, "the reference finished before it could be interrupted: " + out[-500:] + err[-1500:]
    assert result.returncode == 130, out + err
    assert f"kl interrupted by {sig}" in out + err and "Traceback" not in err, out + err
    folder = Path(out.strip().splitlines()[-1].removeprefix("run folder: "))
    m = manifest_of(folder)
    assert m["flow"]["status"] == "interrupted" and m["lanes"]["f16"]["status"] == "interrupted", m["flow"]
    assert sig in m["lanes"]["f16"]["reason"], m["lanes"]["f16"]
    assert run_cli("verify", str(folder)).returncode == 0
    assert no_llama_server_left(range(reference, candidate + 1))


def test_bad_kl_files_are_one_line_and_exit_2(tmp_path):
    cases = {
        "unknown.yaml": ({"candidates": ["q9"]}, "candidates[0]"),
        "extra.yaml": ({"bars": {"max_mean_abs_dlogprob": 0.1, "max_kl": 1}}, "bars.max_kl"),
        "nobar.yaml": ({"bars": {}}, "bars"),
    }
    for name, (change, field) in cases.items():
        data = {"prompts": str(PROMPTS), "reference": "f16", "candidates": ["q8"],
                "lanes": {"f16": llama_lane(18251), "q8": llama_lane(18252)},
                "bars": {"max_mean_abs_dlogprob": 0.1}, **change}
        (tmp_path / name).write_text(yaml.safe_dump(data))
        result = run_cli("kl", str(tmp_path / name), timeout=60)
        assert result.returncode == 2, result.stdout + result.stderr
        lines = result.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith(f"lanebench: error: {tmp_path / name}: {field}:"), lines
        assert "Fix:" in lines[0] and "Traceback" not in result.stderr
    result = run_cli("kl", str(tmp_path / "missing.yaml"), timeout=60)
    assert result.returncode == 2 and "no such file" in result.stderr


# --- pieces, without a server ----------------------------------------------------------------


def test_inventory_lanes_lose_their_speculation(tmp_path):
    from tasks.kl.config import load_kl_file, resolve_lanes

    inventory = tmp_path / "hosts.yaml"
    inventory.write_text(yaml.safe_dump({"hosts": {"localhost": {"address": "127.0.0.1"}}, "lanes": {"spec": {
        "host": "localhost", "engine": "llamacpp", "model": {"path": str(TARGET)},
        "drafter": {"path": str(TARGET)}, "speculative": {"method": "draft-simple", "k": 4},
        "flags": ["--spec-draft-n-min", "0", "--metrics", "--spec-draft-p-min=0.0", "--draft-max", "4"],
        "bench": {"decode": {"prompts": str(PROMPTS)}}}}}))
    path = kl_file(tmp_path, "inv.yaml", candidates=["b"], inventory=str(inventory),
                   reference="a", lanes={"a": {"lane": "spec", "port": 18261}, "b": {"lane": "spec", "port": 18262}})
    a = resolve_lanes(load_kl_file(path), path)["a"]
    assert a.lane.drafter is None and a.lane.speculative is None and a.lane.port == 18261
    assert a.lane.flags == ["--metrics"]
    assert a.dropped_flags == ["--spec-draft-n-min", "0", "--spec-draft-p-min=0.0", "--draft-max", "4"]
    assert a.lane.model.path == str(TARGET) and a.lane.slots == 1


def test_paired_bootstrap_is_seeded_and_sees_a_real_gap():
    from tasks.kl.stats import paired_bootstrap

    rng = np.random.default_rng(1)
    n = np.full(40, 128.0)
    b = rng.gamma(2.0, 0.05, 40) * n
    a = b * 0.8  # a closer on every prompt
    first = paired_bootstrap(a, b, n, 2000, 7)
    assert first == paired_bootstrap(a, b, n, 2000, 7)
    gap, low, high = first
    assert low <= gap <= high < 0
    noise = b * rng.normal(1.0, 0.05, 40)  # no systematic difference
    _, low, high = paired_bootstrap(noise, b, n, 2000, 7)
    assert low < 0 < high


def test_bars_name_what_they_miss():
    from tasks.kl.config import Bars
    from tasks.kl.stats import bar_failures

    stats = {"mean_abs_dlogprob": 0.12, "p95_abs_dlogprob": 0.6, "argmax_flip_share": 0.02}
    assert bar_failures(stats, Bars(max_mean_abs_dlogprob=0.1, max_argmax_flip_share=0.05)) == ["mean_abs_dlogprob 0.12 > 0.1"]
    assert bar_failures(stats, Bars(max_p95_abs_dlogprob=1.0)) == []


def test_llamacpp_probes_one_position_each_with_the_forced_token_sampled():
    from tasks.engines import engine_for
    from tasks.wire.kl_probes import ProbeRetry

    engine = engine_for("llamacpp")
    probes = engine.forced_probes([1, 87, 107, 104, 259], 3)
    assert [p.positions for p in probes] == [[3], [4]]
    assert probes[0].body["prompt"] == [1, 87, 107] and probes[0].body["logit_bias"] == [[104, 1.0e4]]
    assert probes[0].body["cache_prompt"] is False and probes[1].body["cache_prompt"] is True
    scored = {"completion_probabilities": [{"id": 104, "logprob": -0.25, "top_logprobs": [{"id": 50, "logprob": -0.1}]}]}
    assert engine.parse_forced(probes[0], scored)[0].model_dump() == {"position": 3, "logprob": -0.25, "argmax": 50}
    # A lone byte token is withheld by the server: the retry samples "a" and reads the whole vocabulary.
    with pytest.raises(ProbeRetry) as retry:
        engine.parse_forced(probes[0], {})
    body = retry.value.probe.body
    assert body["logit_bias"] == [["a", 1.0e4]] and body["n_probs"] >= 1 << 16
    full = {"completion_probabilities": [{"id": 100, "logprob": -9.0, "top_logprobs": [
        {"id": 50, "logprob": -0.1}, {"id": 104, "logprob": -0.3}, {"id": 100, "logprob": -9.0}]}]}
    assert engine.parse_forced(retry.value.probe, full)[0].logprob == -0.3


@pytest.mark.parametrize("name", ["sglang", "vllm"])
def test_recorded_teacher_forced_responses(name):
    from tasks.engines import engine_for

    engine = engine_for(name)
    rec = json.loads((FIXTURES / name / "kl_responses.json").read_text())
    tokens = engine.parse_tokenize(rec["tokenize"])
    assert tokens == [128000, 791, 4062, 14198, 39935, 35308]
    assert engine.parse_greedy_tokens(rec["greedy"]) == [927, 279, 16053]
    (probe,) = engine.forced_probes(tokens, 3)
    assert probe.positions == [3, 4, 5] and probe.forced == [14198, 39935, 35308]
    got = [s.model_dump() for s in engine.parse_forced(probe, rec["forced"])]
    assert got == [{"position": 3, "logprob": -0.0234375, "argmax": 14198},
                   {"position": 4, "logprob": -2.71875, "argmax": 40289},
                   {"position": 5, "logprob": -0.00390625, "argmax": 35308}]
    wrong = probe.model_copy(update={"forced": [14198, 1, 35308]})
    with pytest.raises(ValueError):
        engine.parse_forced(wrong, rec["forced"])
