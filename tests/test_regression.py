"""Regression detection: the statistics on known cases, then a sequence of real rehearsal nightlies
on a real Prefect server where one run, with the weak drafter, is flagged and the others are not."""

from __future__ import annotations

import io
import json
import re
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


def test_the_weak_drafter_night_is_a_regression_with_its_interval(nightlies):
    assert nightlies["codes"][3] == 1
    folder = nightlies["folders"][3]
    df = _comparison(folder).set_index("metric")
    for prompt_class in ("prose", "code"):
        row = df.loc[f"acceptance_length@{prompt_class}"]
        assert row.verdict == "regression" and row.baseline_runs == 3
        assert row.change_pct < -20 and row.ci_low_pct <= row.change_pct <= row.ci_high_pct < 0
    m = manifest_of(folder)
    entry = next(a for a in m["artifacts"] if a["kind"] == "regression")
    assert entry["validation"] == "passed" and entry["path"] == "rehearsal/regression.parquet"
    assert any("drafter.path" in w and "drafter-weak" in w for w in m["lanes"]["rehearsal"]["warnings"])
    report = (folder / "report.md").read_text()
    assert re.search(r"- verdict: \*\*FAILED\*\* \(\d+ regressions\)", report), report[:800]
    assert "**regression** rehearsal `acceptance_length@code`" in report
    for png in ("concurrency.png", "acceptance.png", "trend.png"):
        assert f"](rehearsal/{png})" in report and (folder / "rehearsal" / png).stat().st_size > 5000
    assert "regression rehearsal acceptance_length@" in nightlies["stderr"]  # the CLI says why it failed


def test_the_failure_is_notified_with_the_regressions(nightlies):
    bodies = nightlies["bodies"]
    assert len(bodies) == 1, bodies  # only the failed night
    body = bodies[0]
    assert body["flow"] == "nightly" and body["state"] == "Failed"
    assert body["run_folder"] == str(nightlies["folders"][3])
    metrics = {r["metric"]: r for r in body["regressions"]}
    assert {"acceptance_length@prose", "acceptance_length@code"} <= set(metrics)
    # Each flagged interval lies wholly on the worse side: below zero where higher is better (the
    # acceptance lengths), above it where lower is (a TTFT that rose on a busy night).
    assert all(r["ci_high_pct"] < 0 if r["better"] == "higher" else r["ci_low_pct"] > 0 for r in metrics.values())
    assert metrics["acceptance_length@code"]["better"] == "higher"
    assert "regression rehearsal acceptance_length@code" in body["text"]


def test_history_answers_which_drafter_produced_the_number(nightlies):
    r = subprocess.run([sys.executable, "-m", "flows.cli", "history", "--artifacts", str(nightlies["artifacts"]),
                        "metric", "rehearsal", "acceptance_length@code", "--csv"],
                       cwd=REPO, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    rows = list(pd.read_csv(io.StringIO(r.stdout), dtype=_HASHES).itertuples())
    assert [row.run for row in rows] == [f.name for f in nightlies["folders"]]
    assert len({row.drafter_sha256 for row in rows[:3]}) == 1 and rows[3].drafter_sha256 != rows[0].drafter_sha256
    assert rows[3].value < rows[0].value and bool(rows[3].regressed) and not any(bool(x.regressed) for x in rows[:3])
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
