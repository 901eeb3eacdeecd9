"""Run history: run folders written by the real RunFolder (GX-validated tables), indexed by DuckDB,
queried through `lanebench history`; no llama-server needed."""

from __future__ import annotations

import io
import re
import subprocess
import sys
import uuid
from pathlib import Path

import duckdb
import pandas as pd
import pytest

from conftest import REPO
from tasks.record.run_folder import RunFolder
from tasks.record.rows import AcceptanceRow, DecodeRow

DRAFTERS = {"good": "1" * 64, "weak": "2" * 64}


def _run(root: Path, flow: str, lanes: dict[str, dict], inventory: Path) -> RunFolder:
    """A finished run folder with one decode and one acceptance table per lane."""
    run = RunFolder(root, flow, str(uuid.uuid4()), inventory)
    for name, spec in lanes.items():
        record = run.lane(name)
        record.status = spec.get("status", "passed")
        record.config = {"host": "localhost", "engine": "llamacpp", "threads": spec.get("threads", 2)}
        record.models = [{"role": "model", "path": "t.gguf", "bytes": 1, "sha256": "a" * 64},
                         {"role": "drafter", "path": f"{spec.get('drafter', 'good')}.gguf", "bytes": 1,
                          "sha256": DRAFTERS[spec.get("drafter", "good")]}]
        record.engine_identity = {"source": "llama-cpp-python==0.3.36", "sha256": "c" * 64}
        tok = spec["tok_s"]
        run.write_table(name, "decode", [DecodeRow(
            lane=name, concurrency=c, repeats=3, aggregate_tok_s=tok * c, aggregate_tok_s_min=tok * c * 0.98,
            aggregate_tok_s_max=tok * c * 1.02, aggregate_spread_pct=4.0, per_user_tok_s=tok, ttft_p50_s=0.1,
            ttft_p95_s=0.2, itl_p50_s=0.01, requests=4 * c, failed_requests=spec.get("failed", 0)) for c in (1, 2)])
        a = spec.get("acceptance", 3.0)
        run.write_table(name, "acceptance", [AcceptanceRow(
            lane=name, prompt_class="prose", k=4, repeats=3, acceptance_length=a, acceptance_length_min=a,
            acceptance_length_max=a, verify_steps=100, accepted=100 * (a - 1), per_position=[0.8, 0.6, 0.4, 0.2],
            source="counters")])
    run.finish()
    return run


@pytest.fixture(scope="module")
def history_root(tmp_path_factory):
    root = tmp_path_factory.mktemp("artifacts")
    inventory = REPO / "hosts.yaml"
    runs = [_run(root, "nightly", {"rehearsal": {"tok_s": tok}}, inventory) for tok in (20.0, 21.0, 19.5, 20.5)]
    runs.append(_run(root, "nightly", {"rehearsal": {"tok_s": 20.0, "failed": 2}}, inventory))  # quarantined
    runs.append(_run(root, "matrix", {"arm-good-k4": {"tok_s": 20.0, "acceptance": 3.2},
                                      "arm-weak-k4": {"tok_s": 14.0, "acceptance": 1.4, "drafter": "weak"}}, inventory))
    return root, runs


_HASHES = {c: str for c in ("git_sha", "model_sha256", "drafter_sha256", "engine_sha256", "inventory_sha256")}


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "flows.cli", "history", *args], cwd=REPO, capture_output=True,
                          text=True, timeout=120)


def _csv(result: subprocess.CompletedProcess) -> pd.DataFrame:
    assert result.returncode == 0, result.stdout + result.stderr
    return pd.read_csv(io.StringIO(result.stdout), dtype=_HASHES)


def test_a_metric_over_the_last_runs_with_what_produced_it(history_root):
    root, runs = history_root
    df = _csv(_cli("--artifacts", str(root), "metric", "rehearsal", "tok_s@c2", "--last", "3", "--csv"))
    # The quarantined run's table never counts; the last three good ones, oldest first.
    assert list(df.run) == [r.path.name for r in runs[1:4]]
    assert list(df.value) == [42.0, 39.0, 41.0]
    assert list(df.lo) == pytest.approx([42 * 0.98, 39 * 0.98, 41 * 0.98])
    assert (df.drafter_sha256 == DRAFTERS["good"]).all() and (df.model_sha256 == "a" * 64).all()
    assert (df.git_sha.str.len() == 40).all() and (df.engine_sha256 == "c" * 64).all()


def test_the_runs_of_a_matrix_side_by_side(history_root):
    root, runs = history_root
    df = _csv(_cli("--artifacts", str(root), "matrix", "--csv")).set_index("arm")
    assert list(df.index) == ["arm-good-k4", "arm-weak-k4"]
    assert df.loc["arm-weak-k4", "acceptance_length@prose"] == pytest.approx(1.4)
    assert df.loc["arm-good-k4", "tok_s@c1"] == pytest.approx(20.0)
    assert df.loc["arm-weak-k4", "drafter_sha256"] == DRAFTERS["weak"]
    # The short flow-run id names a run as well as its folder does.
    by_id = _csv(_cli("--artifacts", str(root), "matrix", runs[-1].path.name.rsplit("_", 1)[1], "--csv"))
    assert len(by_id) == 2


def test_provenance_and_the_list_of_runs(history_root):
    root, runs = history_root
    prov = _csv(_cli("--artifacts", str(root), "provenance", runs[0].path.name, "--csv"))
    assert prov.loc[0, "drafter_sha256"] == DRAFTERS["good"] and prov.loc[0, "engine_source"].startswith("llama-cpp")
    listed = _csv(_cli("--artifacts", str(root), "--flow", "nightly", "--csv"))
    assert list(listed.run) == [r.path.name for r in runs[:5]]
    table = _cli("--artifacts", str(root), "metrics", "--lane", "rehearsal")  # the rich table
    assert table.returncode == 0 and "tok_s@c1" in table.stdout and "acceptance_length@prose" in table.stdout


def test_bad_questions_get_one_line_and_exit_2(history_root):
    root, _ = history_root
    r = _cli("--artifacts", str(root), "metric", "rehearsal", "tok_s@c99")
    assert r.returncode == 2 and "lanebench history metrics" in r.stderr
    r = _cli("--artifacts", str(root / "nope"))
    assert r.returncode == 2 and "no such folder" in r.stderr


def test_the_index_is_rebuilt_from_the_folders_and_stays_outside_them(history_root):
    root, runs = history_root
    r = _cli("--artifacts", str(root), "reindex")
    assert r.returncode == 0, r.stderr
    with duckdb.connect(str(root / ".history.duckdb"), read_only=True) as con:
        assert con.execute("SELECT count(*) FROM runs").fetchone()[0] == len(runs)
        assert con.execute("SELECT count(*) FROM decode").fetchone()[0] == 2 * 4 + 2 * 2  # quarantined left out
    verify = subprocess.run([sys.executable, "-m", "flows.cli", "verify", str(runs[0].path)], cwd=REPO,
                            capture_output=True, text=True, timeout=60)
    assert verify.returncode == 0, verify.stdout


def test_baselines_skip_regressed_and_failed_runs(tmp_path):
    """A night flagged as a regression, or whose lane failed, never becomes the standard for the next."""
    from tasks.record.history import open_index
    from tasks.record.regression import RegressionPolicy, compare_lane

    inventory = REPO / "hosts.yaml"
    good = [_run(tmp_path, "nightly", {"rehearsal": {"tok_s": tok}}, inventory) for tok in (20.0, 20.4, 19.8)]
    _run(tmp_path, "nightly", {"rehearsal": {"tok_s": 5.0, "status": "failed"}}, inventory)
    slow = _run(tmp_path, "nightly", {"rehearsal": {"tok_s": 12.0, "threads": 1}}, inventory)
    con = open_index(tmp_path)
    first = compare_lane(con, slow.path.name, "rehearsal", RegressionPolicy())
    rows = {r.metric: r for r in first.rows}
    # One slow night is suspect (speed moves with whatever shares the host); the next confirms it.
    assert rows["tok_s@c1"].verdict == "suspect" and not first.regressions
    assert "suspect, not yet a regression" in first.suspect_flags()[0].message
    assert rows["tok_s@c1"].baseline_from.split(",") == [r.path.name for r in good]
    assert rows["acceptance_length@prose"].verdict == "no change"
    assert first.config_changes == ["threads: 2 -> 1"]
    slow.write_table("rehearsal", "regression", first.rows)
    slow.finish()
    again = _run(tmp_path, "nightly", {"rehearsal": {"tok_s": 12.2, "threads": 1}}, inventory)
    second = compare_lane(open_index(tmp_path), again.path.name, "rehearsal", RegressionPolicy())
    rows = {r.metric: r for r in second.rows}
    assert rows["tok_s@c1"].verdict == "regression"  # confirmed, still against the good runs only
    assert rows["tok_s@c1"].baseline_from.split(",") == [r.path.name for r in good]
    again.write_table("rehearsal", "regression", second.rows)
    again.finish()
    after = _run(tmp_path, "nightly", {"rehearsal": {"tok_s": 20.1}}, inventory)
    rows = {r.metric: r for r in compare_lane(open_index(tmp_path), after.path.name, "rehearsal",
                                              RegressionPolicy()).rows}
    assert slow.path.name not in rows["tok_s@c1"].baseline_from and rows["tok_s@c1"].verdict == "no change"
    assert again.path.name not in rows["tok_s@c1"].baseline_from
    # `since` starts a new baseline after a deliberate change: too few runs since then to judge.
    since = compare_lane(open_index(tmp_path), after.path.name, "rehearsal",
                         RegressionPolicy(since=slow.path.name)).rows
    assert {r.verdict for r in since if not r.metric.startswith("ttft_p95")} == {"no baseline"}


def test_the_report_shows_the_comparison_and_the_trend(tmp_path):
    """report.md from the run folder: the verdict line, the comparison table (judged or not) and the plots."""
    from flows.nightly import _history
    from tasks.record import plots
    from tasks.record.history import open_index
    from tasks.record.regression import RegressionPolicy, compare_lane
    from tasks.report.report import embed_images, render

    inventory = REPO / "hosts.yaml"
    runs = [_run(tmp_path, "nightly", {"rehearsal": {"tok_s": tok}}, inventory) for tok in (20.0, 20.3, 19.9, 13.0)]
    con = open_index(tmp_path)
    first = compare_lane(con, runs[0].path.name, "rehearsal", RegressionPolicy())
    runs[0].write_table("rehearsal", "regression", first.rows)
    text = render(runs[0])
    assert "- verdict: **passed**" in text and "rehearsal: no baseline yet" in text
    assert "| tok_s@c1 | 20 | none |  |  | 5% | no baseline |" in text
    last = compare_lane(con, runs[-1].path.name, "rehearsal", RegressionPolicy(confirm_runs={}))  # fails at once
    runs[-1].write_table("rehearsal", "regression", last.rows)
    png = plots.trend(_history(con, "rehearsal", [r.metric for r in last.rows]), last.rows, runs[-1].path.name,
                      runs[-1].lane_dir("rehearsal") / "trend.png", "rehearsal")
    runs[-1].register("rehearsal", str(png.relative_to(runs[-1].path)), "plot")
    text = render(runs[-1])
    assert "- verdict: **FAILED** (2 regressions)" in text  # tok/s at both levels
    assert re.search(r"\*\*regression\*\* rehearsal `tok_s@c1`: -35\.\d% \[-\d+\.\d%, -\d+\.\d%\]", text), text
    assert "(shaded: the noise band tonight was judged against)](rehearsal/trend.png)" in text
    assert "data:image/png;base64," in embed_images(text, runs[-1].path)


def test_kl_figures_are_judged_against_earlier_kl_runs(tmp_path):
    """The KL gate's candidates appear as lanes of a `kl` run; compare_lane judges them as it judges nightly lanes."""
    from tasks.record.history import open_index
    from tasks.wire.kl_probes import KlSummaryRow
    from tasks.record.regression import RegressionPolicy, compare_lane

    def kl_run(mean: float) -> RunFolder:
        run = RunFolder(tmp_path, "kl", str(uuid.uuid4()), REPO / "hosts.yaml")
        rows = [KlSummaryRow(lane="reference", role="reference", status="complete", prompts=8, positions=256,
                             positions_expected=256, mean_abs_dlogprob=0.0, median_abs_dlogprob=0.0,
                             p95_abs_dlogprob=0.0, max_abs_dlogprob=0.0, argmax_flip_share=0.0, verdict="exact"),
                KlSummaryRow(lane="q4", role="candidate", status="complete", prompts=8, positions=256,
                             positions_expected=256, mean_abs_dlogprob=mean, median_abs_dlogprob=mean / 2,
                             p95_abs_dlogprob=mean * 4, max_abs_dlogprob=mean * 10, argmax_flip_share=0.02,
                             verdict="pass")]
        _, entry = run.write_table("gate", "kl_summary", rows)
        assert entry.validation == "passed", entry.failed_expectations
        run.finish()
        return run

    runs = [kl_run(m) for m in (0.050, 0.052, 0.049, 0.120)]
    con, last = open_index(tmp_path), runs[-1].path.name
    q4 = {r.metric: r for r in compare_lane(con, last, "q4", RegressionPolicy()).rows}
    assert q4["kl_mean_abs_dlogprob"].verdict == "regression" and q4["kl_mean_abs_dlogprob"].ci_low_pct > 0
    assert q4["kl_argmax_flip_share"].verdict == "no change"
    # The reference against itself reads 0: no percent change exists, so no verdict either way.
    assert {r.verdict for r in compare_lane(con, last, "reference", RegressionPolicy()).rows} == {"no baseline"}
