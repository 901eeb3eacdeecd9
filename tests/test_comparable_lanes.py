"""Comparable or refused (issue 24) on a real llama-server: for each comparison lanebench makes, a
lane pair that differs in one field that is not under test is refused or flagged naming that
field, and the same pair with only the tested variable changed compares cleanly.

- nightly against its baseline window: an engine replaced in place, then a model replaced at the
  same path, are refused naming engine.sha256 / model.sha256; a night that changed nothing compares;
- speculative lane against the plain lane of the same target in one night: a plain lane launched
  with another context is NOT COMPARABLE naming --ctx-size; the plain lane that differs only in
  speculation is judged; a night with only the speculative lane is judged against its last plain
  baseline from history, or says none exists;
- matrix arms against no speculation: an arm with a quantized KV cache is NOT COMPARABLE naming
  -ctk q8_0, arms that differ only in drafter are not; matrix against its earlier registration:
  a drafter re-made under its old label is refused naming its sha256, an unchanged rerun is "same";
- KL candidate against the reference: a reference with a q8_0 KV cache or a shorter context is
  flagged in the headline, a clean pair is not; positions scored are stated against those asked.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import time
from pathlib import Path

import pandas as pd
import pytest

from conftest import REPO, manifest_of, no_llama_server_left, run_cli, run_folder_of, shipped_inventory, write_inventory
from prefect_stack import prefect_server
from test_kl import PROMPTS, TARGET, kl_file, llama_lane
from test_matrix import MODELS, matrix_inventory, small_matrix, write_matrix
from test_regression import _DRIVER
from test_safe_by_default_lanes import _new_user_lane


# Seven nightlies or three matrices in one fixture: about 15 min on the busy 2-core VM.
pytestmark = pytest.mark.timeout(2400)

# This file's ports: other suites hand out 18300-18399 (Prefect servers) and their own ranges.
NIGHT_PORTS, MATRIX_PORT, KL_PORTS = range(18800, 18830), 18830, range(18840, 18860)
_handed: set[int] = set()


def _port(ports: range) -> int:
    """A port of `ports` that nobody listens on and this process has not handed out yet."""
    import socket

    for port in ports:
        if port in _handed:
            continue
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        _handed.add(port)
        return port
    raise RuntimeError(f"no free port in {ports}")


def _quantized(llama_bin: Path, source: Path, out: Path) -> Path:
    """`source` re-made as Q8_0 by the pinned llama-quantize: a model with other bytes, same vocabulary."""
    subprocess.run([str(llama_bin / "llama-quantize"), str(source), str(out), "Q8_0"], check=True,
                   capture_output=True, timeout=300)
    return out


def _wrapper(path: Path, llama_bin: Path, build: str) -> None:
    """An engine binary at a fixed path whose bytes change with `build` (an in-place upgrade)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(f"#!/bin/sh\n# build {build}\nexec {llama_bin / 'llama-server'} \"$@\"\n")
    path.chmod(0o755)


# --- nightly: regression baseline and speculation judged ---------------------------------------

def _lanes(tmp: Path, names: list[str]) -> dict:
    """The small lanes of one night, on fresh ports; all serve tmp/models/target.gguf through the
    engine at tmp/bin/llama-server."""
    model = {"path": str(tmp / "models" / "target.gguf")}
    binary = str(tmp / "bin" / "llama-server")
    out = {}
    for name in names:
        lane = _new_user_lane(_port(NIGHT_PORTS), model=model, binary=binary,
                              drafter={"path": str(MODELS / "drafter-good-f16.gguf")})
        lane["bench"]["decode"]["concurrency"] = [1, 2]
        if name != "spec":
            lane.update(drafter=None, speculative=None, flags=[])
            lane["bench"].pop("acceptance")
        if name == "plain-ctx":
            lane["context"] = 384  # the one field that is not speculation (the longest prose prompt is 341 tokens)
        out[name] = lane
    return out


@pytest.fixture(scope="module")
def nights(tmp_path_factory, llama_bin):
    """Seven nightlies into one artifacts folder, through the CLI's main() on a real Prefect server."""
    tmp = tmp_path_factory.mktemp("comparable")
    (tmp / "models").mkdir()
    shutil.copy(TARGET, tmp / "models" / "target.gguf")
    _wrapper(tmp / "bin" / "llama-server", llama_bin, "1")
    plan = [["spec"], ["spec", "plain", "plain-ctx"], ["plain"], ["spec"], ["plain"]]
    hosts = []
    for i, names in enumerate(plan):
        inv = shipped_inventory()
        inv["lanes"] = _lanes(tmp, names)
        hosts.append(write_inventory(tmp / f"night{i}", inv))
    artifacts = tmp / "artifacts"
    t0 = time.monotonic()
    with prefect_server(tmp / "prefect-home") as env:
        env = env | {"PYTHONUNBUFFERED": "1"}

        def run(*inventories: Path) -> subprocess.CompletedProcess:
            r = subprocess.run([sys.executable, "-c", _DRIVER, str(artifacts), *map(str, inventories)], cwd=REPO,
                               env=env, capture_output=True, text=True, timeout=1800)
            assert "EXIT" in r.stdout, r.stdout[-3000:] + r.stderr[-5000:]
            return r

        ordinary = run(*hosts)
        # The engine upgraded in place (same path, other bytes), then the model file replaced at its path.
        _wrapper(tmp / "bin" / "llama-server", llama_bin, "2")
        inv = shipped_inventory()
        inv["lanes"] = _lanes(tmp, ["plain"])
        engine = run(write_inventory(tmp / "night5", inv))
        _quantized(llama_bin, TARGET, tmp / "q8.gguf").replace(tmp / "models" / "target.gguf")
        inv["lanes"] = _lanes(tmp, ["plain"])
        model = run(write_inventory(tmp / "night6", inv))
    print(f"seven nightlies: {time.monotonic() - t0:.1f} s")
    out = ordinary.stdout + engine.stdout + model.stdout
    codes = [int(line.split()[1]) for line in out.splitlines() if line.startswith("EXIT ")]
    folders = [Path(line.removeprefix("run folder: ")) for line in out.splitlines() if line.startswith("run folder: ")]
    assert len(codes) == len(folders) == 7, out[-3000:] + ordinary.stderr[-3000:]
    return {"codes": codes, "folders": folders, "stderr": ordinary.stderr + engine.stderr + model.stderr}


def _speculation_lines(folder: Path) -> list[str]:
    text = (folder / "report.md").read_text()
    assert "## Speculation against no speculation" in text, text[:1500]
    section = text.split("## Speculation against no speculation")[1].split("\n## ")[0]
    return [line for line in section.splitlines() if line.startswith("- ")]


def _regression(folder: Path, lane: str = "plain") -> pd.DataFrame:
    return pd.read_parquet(folder / lane / "regression.parquet")


def test_a_plain_lane_launched_differently_is_not_compared_and_the_equal_one_is(nights):
    folder = nights["folders"][1]
    assert nights["codes"][1] == 0, nights["stderr"][-3000:]
    lanes = manifest_of(folder)["lanes"]
    assert {n: r["status"] for n, r in lanes.items()} == {"spec": "passed", "plain": "passed", "plain-ctx": "passed"}
    lines = _speculation_lines(folder)
    (flagged,) = [line for line in lines if "NOT COMPARABLE" in line]
    assert "spec against plain-ctx (plain, same target) differs beyond speculation" in flagged
    # Both values, by argv words. The server pads each slot to 512 either way: only the launch says so.
    assert "launch: --ctx-size 3072 -> --ctx-size 4096" in flagged, flagged
    judged = [line for line in lines if " at C=" in line]
    assert [line.split(" at C=")[1][0] for line in judged] == ["1", "2"], lines  # each concurrency, against plain
    assert all("for plain (plain, same target)" in line for line in judged) and not any("plain-ctx" in j for j in judged)
    report = (folder / "report.md").read_text()
    assert "verdict: **passed, FLAGGED**" in report and "spec: NOT COMPARABLE" in report


def test_a_speculative_only_night_is_judged_against_its_last_plain_baseline(nights):
    first, _, plain_night, spec_only = nights["folders"][:4]
    (none,) = _speculation_lines(first)
    assert "no verdict on speculation for spec" in none and "no plain baseline exists" in none
    lines = _speculation_lines(spec_only)
    assert [line.split(" at C=")[1][0] for line in lines] == ["1", "2"], lines
    for line in lines:
        assert line.startswith(("- **SPECULATION LOSES at C=", "- speculation wins at C="))
        assert f"for plain in {plain_night.name} (last plain baseline)" in line, line  # the newest equal plain run


def test_a_night_that_changed_nothing_compares_cleanly(nights):
    """Judged against both earlier plain nights (whatever the busy box made of its speed), never refused."""
    df = _regression(nights["folders"][4])
    speed = df[df.metric.str.startswith("tok_s")]
    assert len(speed) == 2 and (speed.baseline_runs == 2).all(), df.to_string()
    assert set(speed.verdict) <= {"no change", "improvement", "regression"}, df.to_string()
    assert not manifest_of(nights["folders"][4])["flow"].get("comparison_refused")


def test_an_engine_upgraded_in_place_refuses_the_comparison(nights):
    folder = nights["folders"][5]
    assert nights["codes"][5] == 1
    refused = manifest_of(folder)["flow"]["comparison_refused"]["plain"]
    assert "engine.sha256: " in refused and "model.sha256" not in refused, refused
    assert set(_regression(folder)[lambda d: d.metric.str.startswith("tok_s")].verdict) == {"not comparable"}
    assert "- verdict: **FAILED** (comparison refused for plain)" in (folder / "report.md").read_text()


def test_a_model_replaced_at_the_same_path_refuses_the_comparison(nights):
    folder = nights["folders"][6]
    assert nights["codes"][6] == 1
    m = manifest_of(folder)
    before = manifest_of(nights["folders"][5])["lanes"]["plain"]["fingerprint"]["model.sha256"]
    after = m["lanes"]["plain"]["fingerprint"]["model.sha256"]
    refused = m["flow"]["comparison_refused"]["plain"]
    assert f"model.sha256: {before[:16]}... -> {after[:16]}..." in refused, refused
    assert "engine.sha256" not in refused
    assert m["lanes"]["plain"]["models"][0]["path"] == manifest_of(nights["folders"][4])["lanes"]["plain"]["models"][0]["path"]
    assert no_llama_server_left(NIGHT_PORTS)


# --- matrix: arms against no speculation, and against the earlier registration -------------------

@pytest.fixture(scope="module")
def matrices(tmp_path_factory, llama_bin):
    """Three runs of one matrix name: with an arm on a q8_0 KV cache; again unchanged; then with the
    drafter labelled `good` re-made (Q8_0) at the same path."""
    tmp = tmp_path_factory.mktemp("matrix-cmp")
    good = tmp / "good.gguf"
    shutil.copy(MODELS / "drafter-good-f16.gguf", good)
    matrix_inventory(tmp, MATRIX_PORT)
    one = {"prompt_sets": {"prose": str(REPO / "testbed" / "prompts" / "prose.jsonl")}, "prompts_per_class": 2,
           "max_tokens": 16, "repeats": 1, "name": "comparable", "inventory": str(tmp / "hosts.yaml"),
           "speed": {"prompt_set": "prose", "concurrency": [1], "max_tokens": 16, "requests_per_stream": 1},
           "bars": [{"metric": "acceptance_length", "class": "prose", "k": 2, "op": ">=", "value": 1.0}]}
    first = small_matrix(**one, arms=[{"drafter": "good", "k": 2}, {"drafter": "weak", "k": 2},
                                      {"drafter": "weak", "k": 2, "name": "weak-k2-q8kv", "flags": ["-ctk", "q8_0"]}])
    first["drafters"]["good"]["path"] = str(good)
    again = small_matrix(**one, arms=[{"drafter": "good", "k": 2}])
    again["drafters"] = {"good": {**first["drafters"]["good"]}}
    artifacts = tmp / "artifacts"
    t0 = time.monotonic()
    runs = [run_cli("matrix", str(write_matrix(tmp, first, "first.yaml")), "--artifacts", str(artifacts)),
            run_cli("matrix", str(write_matrix(tmp, again, "again.yaml")), "--artifacts", str(artifacts))]
    _quantized(llama_bin, MODELS / "drafter-good-f16.gguf", tmp / "good-q8.gguf").replace(good)
    runs.append(run_cli("matrix", str(write_matrix(tmp, again, "again.yaml")), "--artifacts", str(artifacts)))
    print(f"three matrix runs: {time.monotonic() - t0:.1f} s")
    return runs


def test_a_matrix_arm_that_differs_beyond_the_drafter_is_flagged_and_the_others_are_not(matrices):
    result = matrices[0]
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    folder = run_folder_of(result)
    m = manifest_of(folder)
    assert {n: r["status"] for n, r in m["lanes"].items()} == dict.fromkeys(
        ["good-k2", "weak-k2", "weak-k2-q8kv", "no-speculation"], "passed")
    lines = m["flow"]["matrix"]["against_no_speculation"]
    flagged = [line for line in lines if line.startswith("NOT COMPARABLE")]
    assert len(flagged) == 1, lines
    assert flagged[0].startswith("NOT COMPARABLE: weak-k2-q8kv differs from no-speculation beyond speculation")
    assert "launch: (absent) -> -ctk q8_0" in flagged[0], flagged[0]  # the field, both values
    report = (folder / "report.md").read_text()
    assert "NOT COMPARABLE: weak-k2-q8kv" in report and "NOT COMPARABLE: good-k2" not in report


def test_a_drafter_remade_under_its_label_refuses_the_earlier_registration_and_an_unchanged_rerun_is_same(matrices):
    first, again, remade = (run_folder_of(r) for r in matrices)
    for r in matrices[1:]:
        assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    same = manifest_of(again)["flow"]["matrix"]
    assert same["earlier_run"]["run"] == first.name and same["earlier_run"]["subject_changes"] == []
    assert f"bars and prompt sets are the same as in the earlier run {first.name}" in (again / "report.md").read_text()
    changed = manifest_of(remade)["flow"]["matrix"]
    before, after = same["drafter_sha256"]["good"], changed["drafter_sha256"]["good"]
    assert before != after and changed["earlier_run"]["run"] == again.name
    assert changed["earlier_run"]["subject_changes"] == [f"drafter good: sha256 {before[:16]}... -> {after[:16]}..."]
    report = (remade / "report.md").read_text()
    assert f"BYTES CHANGED under the same label since the earlier run {again.name}" in report
    assert "the same as in the earlier run" not in report
    assert "BYTES CHANGED" in matrices[2].stderr
    assert no_llama_server_left(range(MATRIX_PORT, MATRIX_PORT + 10))


# --- KL: the reference is what it claims -------------------------------------------------------------

@pytest.fixture(scope="module")
def kl_runs(tmp_path_factory, llama_bin):
    """Three small KL runs of the same Q8_0 candidate: against a clean F16 reference, one served with
    a q8_0 KV cache, and one with less context than the candidate (too little for every token asked)."""
    tmp = tmp_path_factory.mktemp("kl-cmp")
    cand = {"quantize": {"type": "Q8_0"}}
    # llama.cpp pads a slot's context to a multiple of 256: 256 holds a 128-token prompt and at most
    # 128 more, so the short reference cannot generate the 160 tokens per prompt asked of it.
    refs = {"clean": {}, "kv": {"flags": ["-ctk", "q8_0"]}, "short": {"context": 256}}
    out = {}
    t0 = time.monotonic()
    for name, ref in refs.items():
        path = kl_file(tmp, f"{name}.yaml", candidates=["q8_0"], tokens_per_prompt=160 if name == "short" else 16,
                       lanes={"f16": llama_lane(_port(KL_PORTS), **ref), "q8_0": llama_lane(_port(KL_PORTS), **cand)})
        result = run_cli("kl", str(path), "--artifacts", str(tmp / "art"), "--prompt-count", "2")
        out[name] = (result, run_folder_of(result))
    print(f"three KL runs: {time.monotonic() - t0:.1f} s")
    return out


def _headline(folder: Path) -> str:
    return manifest_of(folder)["flow"]["kl"]["headline"]


def test_a_clean_reference_is_not_flagged_and_states_positions_scored(kl_runs):
    result, folder = kl_runs["clean"]
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    assert _headline(folder) == "PASS"
    assert manifest_of(folder)["flow"]["kl"]["flags"] == []
    assert "| q8_0 | candidate | complete | 32/32 |" in (folder / "report.md").read_text()


def test_a_reference_with_a_quantized_kv_cache_is_flagged_in_the_headline(kl_runs):
    _, folder = kl_runs["kv"]
    headline = _headline(folder)
    assert ", FLAGGED: the reference f16 was served with a quantized KV cache (-ctk q8_0)" in headline, headline
    assert "**FLAG** the reference f16 was served with a quantized KV cache (-ctk q8_0)" in (folder / "report.md").read_text()


def test_a_reference_with_less_context_is_flagged_and_positions_asked_are_stated(kl_runs):
    _, folder = kl_runs["short"]
    headline = _headline(folder)
    assert "the reference f16 ran with 256 tokens of context, candidate q8_0 with 512" in headline, headline
    facts = manifest_of(folder)["flow"]["kl"]
    assert facts["positions"] < 320  # the reference ran out of context before 160 tokens per prompt
    assert f"ONLY f16 generated {facts['positions']}/320 positions asked" in headline, headline
    assert no_llama_server_left(KL_PORTS)
