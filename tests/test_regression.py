"""Regression detection: the statistics on known cases, then a sequence of real rehearsal nightlies
on a real Prefect server where one run, with the weak drafter, is refused as a comparison and the others pass."""

from __future__ import annotations

import io
import json
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest

from conftest import REPO, manifest_of, shipped_inventory, write_inventory
from prefect_stack import Receiver, api_call, free_port, prefect_server
from tasks.record.regression import change_interval, t_quantile, verdict


@pytest.mark.parametrize(("p", "df", "expected"), [(0.975, 1, 12.7062), (0.975, 2, 4.3027), (0.975, 4, 2.7764),
                                                   (0.975, 30, 2.0423), (0.95, 3, 2.3534), (0.995, 10, 3.1693)])
def test_t_quantile_matches_the_tables(p, df, expected):
    assert t_quantile(p, df) == pytest.approx(expected, abs=1e-3)


def test_a_real_slowdown_is_flagged_and_noise_is_not():
    baseline = [20.4, 19.7, 20.3, 20.0, 19.8]  # ~1.5 % run-to-run spread
    slow = change_interval(16.0, baseline, 0.95)
    assert slow.change_pct == pytest.approx(-20.0, abs=0.5)
    assert slow.high_pct < 0 and verdict("higher", slow.change_pct, slow.low_pct, slow.high_pct, 5.0) == "regression"
    noisy = change_interval(19.5, baseline, 0.95)
    assert noisy.low_pct < 0 < noisy.high_pct
    assert verdict("higher", noisy.change_pct, noisy.low_pct, noisy.high_pct, 5.0) == "no change"
    # Lower is better for latency: a rise is the regression.
    up = change_interval(1.5, [1.0, 1.02, 0.98], 0.95)
    assert verdict("lower", up.change_pct, up.low_pct, up.high_pct, 10.0) == "regression"
    # Sure but too small to matter: not a red morning.
    tiny = change_interval(19.0, [20.0, 20.01, 19.99, 20.0], 0.95)
    assert tiny.high_pct < 0 and verdict("higher", tiny.change_pct, tiny.low_pct, tiny.high_pct, 5.0) == "no change"


def test_a_small_window_is_honest_about_its_spread():
    """Two noisy baseline runs cannot tell a 2x change from noise; five quiet ones can tell 10 %."""
    wide = change_interval(40.0, [20.0, 30.0], 0.95)
    assert wide.low_pct < 0 < wide.high_pct
    narrow = change_interval(18.0, [20.1, 19.9, 20.0, 20.2, 19.8], 0.95)
    assert narrow.high_pct < 0


# --- real nightlies --------------------------------------------------------------------------

# The CLI's own main(), several times in one process: Prefect and GX are imported once, which
# keeps five nightlies inside the time budget on two cores.
_DRIVER = """
import sys
from flows.cli import main
for hosts in sys.argv[2:]:
    print(f"EXIT {main(['nightly', '--hosts', hosts, '--artifacts', sys.argv[1]])}", flush=True)
"""


def _reduced(folder, drafter: str = "drafter-good-f16.gguf"):
    """The rehearsal lane, small: two levels, one repeat, two prompt classes (run-to-run spread is
    what the test judges by, so more repeats buy nothing here). Its own port each night (a
    just-closed port lingers in TIME_WAIT, and preflight refuses a taken port)."""
    inv = shipped_inventory()
    lane = inv["lanes"]["rehearsal"]
    lane["port"] = free_port()
    lane["bench"]["repeats"] = 1
    lane["bench"]["decode"] |= {"concurrency": [1, 2], "max_tokens": 24}
    lane["bench"]["decode"].pop("requests_per_level", None)  # the "too few samples" path is judged here
    for bench in ("prefill", "accuracy", "capacity"):  # judged in tests/test_benches.py
        lane["bench"].pop(bench, None)
    acc = lane["bench"]["acceptance"]
    acc |= {"prompts_per_class": 2, "max_tokens": 32, "classes": {c: acc["classes"][c] for c in ("prose", "code")}}
    lane["drafter"] = {"path": f"testbed/models/{drafter}", "bytes": (REPO / "testbed/models" / drafter).stat().st_size}
    return write_inventory(folder, inv)


@pytest.fixture(scope="module")
def nightlies(tmp_path_factory, llama_bin):
    """Three ordinary nightlies, then one with the weak drafter, through the CLI on a real server."""
    tmp = tmp_path_factory.mktemp("regression")
    artifacts = tmp / "artifacts"
    hosts = [_reduced(tmp / f"night{i}") for i in range(3)]
    hosts.append(_reduced(tmp / "weak", "drafter-weak-f16.gguf"))
    with prefect_server(tmp / "prefect-home") as env, Receiver() as receiver:
        env = env | {"LANEBENCH_NOTIFY_URL": receiver.url, "PYTHONUNBUFFERED": "1"}
        result = subprocess.run([sys.executable, "-c", _DRIVER, str(artifacts), *map(str, hosts)], cwd=REPO, env=env,
                                capture_output=True, text=True, timeout=900)
        assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-5000:]
        artifacts_on_server = api_call(env["PREFECT_API_URL"], "POST", "/artifacts/filter",
                                       json={"artifacts": {"key": {"any_": ["nightly-report"]}}}).json()
    codes = [int(line.split()[1]) for line in result.stdout.splitlines() if line.startswith("EXIT ")]
    folders = [line.removeprefix("run folder: ") for line in result.stdout.splitlines()
               if line.startswith("run folder: ")]
    return {"codes": codes, "folders": [Path(f) for f in folders], "bodies": receiver.bodies,
            "artifacts": artifacts, "stdout": result.stdout, "stderr": result.stderr,
            "server_artifacts": artifacts_on_server}


_HASHES = {c: str for c in ("git_sha", "model_sha256", "drafter_sha256", "engine_sha256")}


def _comparison(folder) -> pd.DataFrame:
    return pd.read_parquet(folder / "rehearsal" / "regression.parquet")


def test_ordinary_nights_pass_and_noise_is_not_flagged(nightlies):
    assert nightlies["codes"][:3] == [0, 0, 0], nightlies["stderr"][-3000:]
    first, second, third = (_comparison(f) for f in nightlies["folders"][:3])
    # < 2 earlier runs; a TTFT p95 over 2 or 4 requests is their maximum, never judged
    for night in (first, second):
        assert set(night.verdict) == {"no baseline", "too few samples"}
        assert set(night[night.verdict == "too few samples"].metric) == {"ttft_p95_s@c1", "ttft_p95_s@c2"}
    assert set(third[third.verdict == "too few samples"].metric) == {"ttft_p95_s@c1", "ttft_p95_s@c2"}
    assert (third[third.verdict != "too few samples"].baseline_runs == 2).all()
    table = third[["metric", "verdict", "change_pct", "ci_low_pct", "ci_high_pct"]].to_string()
    # Greedy acceptance is deterministic: any flag on it would be a false alarm. Speed on a shared
    # 2-core box moves with whatever else runs (a night measured while another job ran, then one
    # without it, reads as an improvement); what must never happen is an ordinary night failing.
    assert set(third[third.family == "acceptance"].verdict) == {"no change"}, table
    assert "regression" not in set(third.verdict), table
    assert set(third.metric) == {"tok_s@c1", "tok_s@c2", "ttft_p95_s@c1", "ttft_p95_s@c2",
                                 "acceptance_length@prose", "acceptance_length@code"}


def test_the_weak_drafter_night_is_refused_naming_the_drafter(nightlies):
    """Another drafter under the lane's name is not noise: the night is refused as a comparison
    (never "regression", never "no change"), naming drafter.sha256 with both values (issue 24)."""
    assert nightlies["codes"][3] == 1
    folder = nightlies["folders"][3]
    df = _comparison(folder).set_index("metric")
    for prompt_class in ("prose", "code"):
        row = df.loc[f"acceptance_length@{prompt_class}"]
        assert row.verdict == "not comparable" and row.baseline_runs == 0
    m = manifest_of(folder)
    good, weak = (manifest_of(f)["lanes"]["rehearsal"]["fingerprint"] for f in nightlies["folders"][2:4])
    assert good["drafter.sha256"] != weak["drafter.sha256"] and good["model.sha256"] == weak["model.sha256"]
    refused = m["flow"]["comparison_refused"]["rehearsal"]
    assert f"drafter.sha256: {good['drafter.sha256'][:16]}... -> {weak['drafter.sha256'][:16]}..." in refused
    entry = next(a for a in m["artifacts"] if a["kind"] == "regression")
    assert entry["validation"] == "passed" and entry["path"] == "rehearsal/regression.parquet"
    assert any("drafter.path" in w and "drafter-weak" in w for w in m["lanes"]["rehearsal"]["warnings"])
    report = (folder / "report.md").read_text()
    assert "- verdict: **FAILED** (comparison refused for rehearsal)" in report, report[:800]
    assert "**COMPARISON REFUSED** rehearsal: not comparable" in report
    for png in ("concurrency.png", "acceptance.png", "trend.png"):
        assert f"](rehearsal/{png})" in report and (folder / "rehearsal" / png).stat().st_size > 5000
    assert "comparison refused: rehearsal" in nightlies["stderr"]  # the CLI says why it failed


def test_the_refusal_is_notified(nightlies):
    bodies = nightlies["bodies"]
    assert len(bodies) == 1, bodies  # only the refused night
    body = bodies[0]
    assert body["flow"] == "nightly" and body["state"] == "Failed"
    assert body["run_folder"] == str(nightlies["folders"][3])
    assert body["regressions"] == [] and "drafter.sha256" in body["text"]


def test_history_answers_which_drafter_produced_the_number(nightlies):
    r = subprocess.run([sys.executable, "-m", "flows.cli", "history", "--artifacts", str(nightlies["artifacts"]),
                        "metric", "rehearsal", "acceptance_length@code", "--csv"],
                       cwd=REPO, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    rows = list(pd.read_csv(io.StringIO(r.stdout), dtype=_HASHES).itertuples())
    assert [row.run for row in rows] == [f.name for f in nightlies["folders"]]
    assert len({row.drafter_sha256 for row in rows[:3]}) == 1 and rows[3].drafter_sha256 != rows[0].drafter_sha256
    assert rows[3].value < rows[0].value and not any(bool(x.regressed) for x in rows)  # refused, not judged
    assert all(len(row.git_sha) == 40 and len(row.model_sha256) == 64 for row in rows)


def test_reports_are_prefect_artifacts_and_folders_verify(nightlies):
    assert len(nightlies["server_artifacts"]) == 4
    assert any("data:image/png;base64," in a["data"] for a in nightlies["server_artifacts"])
    for folder in nightlies["folders"]:
        r = subprocess.run([sys.executable, "-m", "flows.cli", "verify", str(folder)], cwd=REPO, capture_output=True,
                           text=True, timeout=60)
        assert r.returncode == 0, r.stdout
        locks = {n: r["host_lock"] for n, r in json.loads((folder / "manifest.json").read_text())["lanes"].items()}
        assert locks["rehearsal"]["limit"] == "gpu:localhost" and locks["rehearsal"]["released_at"]


# --- comparable or refused (issue 24) ----------------------------------------------------------

def _night(root: Path, tok: float, model_sha: str, engine_sha: str = "c" * 64):
    """A finished nightly run folder written by the real RunFolder, its lane's fingerprint recorded
    as flows/lane.py records it."""
    import uuid

    from tasks.record.fingerprint import fingerprint
    from tasks.record.rows import DecodeRow
    from tasks.record.run_folder import RunFolder

    run = RunFolder(root, "nightly", str(uuid.uuid4()), REPO / "hosts.yaml")
    record = run.lane("rehearsal")
    record.status = "passed"
    record.config = {"host": "localhost", "engine": "llamacpp", "bench": {"repeats": 3, "decode": {
        "concurrency": [1, 2], "max_tokens": 64, "prompts": "testbed/prompts/prose.jsonl"}}}
    record.models = [{"role": "model", "path": "t.gguf", "bytes": 1, "sha256": model_sha}]
    record.engine_identity = {"source": "llama-cpp", "sha256": engine_sha}
    record.launch_command = "llama-server -m t.gguf --port 18080 -c 4096"
    record.fingerprint = fingerprint(record, run.manifest.host, REPO)
    run.write_table("rehearsal", "decode", [DecodeRow(
        lane="rehearsal", concurrency=c, repeats=3, aggregate_tok_s=tok * c, aggregate_tok_s_min=tok * c * 0.98,
        aggregate_tok_s_max=tok * c * 1.02, aggregate_spread_pct=4.0, per_user_tok_s=tok, ttft_p50_s=0.1,
        ttft_p95_s=0.2, itl_p50_s=0.01, requests=4 * c, failed_requests=0) for c in (1, 2)])
    run.finish()
    return run


def test_a_replaced_model_file_refuses_the_comparison_and_baselines_hold_the_fingerprint(tmp_path):
    """The seeds' -50.8 % "no change": the model file at the same path replaced. The night is refused,
    naming model.sha256 with both values; baselines are drawn only from fingerprint-equal nights."""
    from tasks.record.history import open_index
    from tasks.record.regression import RegressionPolicy, compare_lane

    a, b = "a" * 64, "b" * 64
    for tok in (20.0, 20.4, 19.8):
        _night(tmp_path, tok, a)
    swapped = _night(tmp_path, 10.0, b)
    assert swapped.manifest.lanes["rehearsal"].fingerprint["model.sha256"] == b
    assert "--port" not in swapped.manifest.lanes["rehearsal"].fingerprint["launch"]
    c = compare_lane(open_index(tmp_path), swapped.path.name, "rehearsal", RegressionPolicy())
    assert {r.verdict for r in c.rows if r.metric.startswith("tok_s")} == {"not comparable"}
    assert "model.sha256: aaaaaaaaaaaaaaaa... -> bbbbbbbbbbbbbbbb..." in c.refused, c.refused
    assert not c.regressions and c.config_changes == []  # the lane config is the same: only the bytes changed
    _, entry = swapped.write_table("rehearsal", "regression", c.rows)  # GX: a refused table is a valid table
    assert entry.validation == "passed", entry.failed_expectations
    # The same change of tok/s with only the night changed (same bytes, same engine) is judged.
    same = _night(tmp_path, 10.0, a)
    c = compare_lane(open_index(tmp_path), same.path.name, "rehearsal", RegressionPolicy(confirm_runs={}))
    assert not c.refused and {r.verdict for r in c.rows if r.metric.startswith("tok_s")} == {"regression"}
    assert swapped.path.name not in c.rows[0].baseline_from  # another model's night is no baseline
    # An engine upgraded in place: refused, naming the engine's sha256.
    upgraded = _night(tmp_path, 20.0, a, engine_sha="d" * 64)
    c = compare_lane(open_index(tmp_path), upgraded.path.name, "rehearsal", RegressionPolicy())
    assert c.refused and "engine.sha256: cccccccccccccccc... -> dddddddddddddddd..." in c.refused
