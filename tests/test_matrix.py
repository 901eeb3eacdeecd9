"""The drafter matrix: the file, the bars, their registration, the verdict, and real runs from the CLI.

Fast tests cover the file model, bar parsing, the verdict logic, the GX suites of the matrix
tables and the bar-change detection on manifests. The slow tests run `lanebench matrix` twice
on a reduced matrix against the real llama-server (a free port in 18400-18499): a complete run
whose candidate fails a bar (exit 0, the verdict says so), then a rerun with one bar edited and
one arm that fails its capacity gate (exit 1, the change and the failed arm are reported).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pandas as pd
import pytest
import yaml

from conftest import REPO, interrupt_cli, llama_server_pid, manifest_of, no_llama_server_left, run_cli, run_folder_of, shipped_inventory, write_inventory
from manifests import matrix_section, write_manifest
from tasks.inventory.models import ConfigError
from tasks.matrix.config import load_matrix
from tasks.matrix.bars import Bar, EarlierRun, earlier_run, register
from tasks.matrix.verdict import ArmClassRow, SpeedRow, drafter_verdicts, judge

MODELS = REPO / "testbed" / "models"
PROMPTS = REPO / "testbed" / "prompts"


# --- the file ---------------------------------------------------------------------------------

def small_matrix(**changes) -> dict:
    """A matrix in the shipped form, with absolute paths so it can live in any folder."""
    data = yaml.safe_load((REPO / "matrix" / "rehearsal.yaml").read_text())
    data["drafters"] = {d: {**ref, "path": str(MODELS / Path(ref["path"]).name)} for d, ref in data["drafters"].items()}
    data["prompt_sets"] = {c: str(PROMPTS / Path(p).name) for c, p in data["prompt_sets"].items()}
    data.update(changes)
    return data


def write_matrix(folder: Path, data: dict, name: str = "m.yaml") -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / name
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


def test_shipped_rehearsal_matrix_is_the_issue_matrix():
    m = load_matrix(REPO / "matrix" / "rehearsal.yaml")
    assert [a.name for a in m.arms] == ["good-k2", "good-k4", "good-k7", "weak-k2", "weak-k4", "weak-k7"]
    assert {a.k for a in m.arms} == {2, 4, 7} and set(m.prompt_sets) == {"prose", "code"}
    assert m.spec.repeats == 3 and m.spec.baseline == "good"
    assert all(a.baseline == (a.drafter == "good") for a in m.arms)
    assert m.target.port == 18080 and m.inventory_path == REPO / "hosts.yaml"


def test_bar_forms_and_words():
    absolute = Bar.model_validate({"metric": "acceptance_length", "class": "prose", "k": 4, "op": ">=", "value": 2.6})
    assert absolute.words() == "prose acceptance length at K=4 >= 2.6"
    within = Bar.model_validate({"metric": "acceptance_length", "class": "code", "k": 7, "relative_to": "baseline",
                                 "within": -0.2})
    assert within.words("incoai") == "code acceptance length at K=7 within -0.2 of baseline (incoai)"
    assert within.canonical() == {"metric": "acceptance_length", "class": "code", "k": 7, "op": ">=", "value": -0.2,
                                  "relative_to": "baseline"}
    speed = Bar.model_validate({"metric": "aggregate_tok_s", "concurrency": 1, "relative_to": "baseline"})
    assert speed.words() == "aggregate tok/s at C=1 >= baseline" and speed.margin == 0.0
    # The registered form parses back to a bar that judges the same way.
    again = Bar.model_validate(within.canonical())
    assert (again.op, again.margin, again.relative_to) == (">=", -0.2, "baseline")
    with pytest.raises(Exception):
        absolute.value = 1.0  # type: ignore[misc]  # frozen: a bar cannot be moved once parsed


BAD = {
    # name: (change to the bars or file, field named, words in the message)
    "unknown field": ({"bars": [{"metric": "acceptance_length", "class": "prose", "op": ">=", "value": 2, "vaule": 3}]},
                      "bars[0].vaule", "remove it"),
    "unknown metric": ({"bars": [{"metric": "acceptance", "class": "prose", "op": ">=", "value": 2}]},
                       "bars[0].metric", "acceptance_length"),
    "strict op": ({"bars": [{"metric": "acceptance_length", "class": "prose", "op": ">", "value": 2}]},
                  "bars[0].op", "'>='"),
    "absolute without value": ({"bars": [{"metric": "acceptance_length", "class": "prose"}]}, "bars[0]", "needs 'value'"),
    "class missing": ({"bars": [{"metric": "acceptance_length", "op": ">=", "value": 2}]}, "bars[0]", "give 'class'"),
    "class not a prompt set": ({"bars": [{"metric": "acceptance_length", "class": "math", "op": ">=", "value": 2}]},
                               "bars[0].class", "use one of: prose, code"),
    "K no arm has": ({"bars": [{"metric": "acceptance_length", "class": "prose", "k": 5, "op": ">=", "value": 2}]},
                     "bars[0]", "judges no arm"),
    "positive within": ({"bars": [{"metric": "acceptance_length", "class": "prose", "relative_to": "baseline",
                                   "within": 0.2}]}, "bars[0].within", "less than or equal to 0"),
    "position beyond K": ({"bars": [{"metric": "position_rate", "class": "prose", "position": 5, "k": 4, "op": ">=",
                                     "value": 0.1}]}, "bars[0].position", "beyond arm"),
    "concurrency not measured": ({"bars": [{"metric": "aggregate_tok_s", "concurrency": 8, "op": ">=", "value": 1}]},
                                 "bars[0].concurrency", "not a speed level"),
    "no baseline arm at K": ({"arms": [{"drafter": "good", "k": 2}, {"drafter": "weak", "k": 4}],
                              "bars": [{"metric": "acceptance_length", "class": "prose", "relative_to": "baseline",
                                        "within": -0.2}]}, "bars[0]", "no baseline arm at K=4"),
    "unknown drafter": ({"arms": [{"drafter": "good", "k": 2}, {"drafter": "strong", "k": 2}]}, "arms[1].drafter",
                        "use one of: good, weak"),
    "unknown target": ({"target": "gb300"}, "target", "use one of: rehearsal"),
    "unsafe arm flag": ({"arms": [{"drafter": "good", "k": [2, 4, 7], "flags": ["--x;rm"]},
                                  {"drafter": "weak", "k": [2, 4, 7]}]}, "arms[0].flags", "not allowed on a command line"),
    "missing prompt set": ({"prompt_sets": {"prose": "/nonexistent/prose.jsonl", "code": str(PROMPTS / "code.jsonl")}},
                           "prompt_sets.prose", "does not exist"),
}


@pytest.mark.parametrize("case", list(BAD))
def test_bad_matrix_is_one_config_error(tmp_path, case):
    change, field, words = BAD[case]
    path = write_matrix(tmp_path, small_matrix(**change))
    with pytest.raises(ConfigError) as e:
        load_matrix(path)
    assert e.value.field == field, str(e.value)
    assert words in str(e.value), str(e.value)


def test_cli_bad_matrix_prints_one_line_and_exits_2(tmp_path):
    path = write_matrix(tmp_path, small_matrix(bars=[{"metric": "acceptance_length", "class": "prose", "op": ">>",
                                                      "value": 2.6}]))
    result = run_cli("matrix", str(path), "--artifacts", str(tmp_path / "artifacts"))
    assert result.returncode == 2, result.stdout + result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in result.stderr
    assert lines[0].startswith(f"lanebench: error: {path}: bars[0].op: ") and "Fix: use '>=' or '<='" in lines[0]
    assert not (tmp_path / "artifacts").exists()  # nothing ran


def test_flow_needs_only_the_matrix_file():
    """What a deployment (prefect.yaml `flows/matrix.py:matrix`) calls: one required, typed parameter."""
    from prefect.flows import load_flow_from_entrypoint

    flow = load_flow_from_entrypoint(str(REPO / "flows" / "matrix.py") + ":matrix")
    schema = flow.parameters.model_dump()
    assert schema["required"] == ["matrix_file"]
    assert schema["properties"]["matrix_file"]["type"] == "string"
    assert schema["properties"]["artifacts_root"]["default"] == "artifacts"


# --- the verdict ------------------------------------------------------------------------------

def _synthetic(m, failed_arm: str | None = None) -> tuple[list[ArmClassRow], list[SpeedRow]]:
    """Rows shaped like measurements: good keeps 0.8/0.56 of each position (code/prose), weak 0.5/0.35."""
    rows, speed = [], []
    for a in m.arms:
        for c in m.prompt_sets:
            row = ArmClassRow(arm=a.name, drafter=a.drafter, revision=a.revision, k=a.k, baseline=a.baseline,
                              status="passed", reason="", prompt_class=c, k_plus_1=a.k + 1)
            if a.name == failed_arm:
                rows.append(row.model_copy(update={"status": "failed", "reason": "capacity: max_running_requests = 1"}))
                continue
            p = (0.8 if a.drafter == "good" else 0.5) * (1.0 if c == "code" else 0.7)
            curve = [p ** (i + 1) for i in range(a.k)]
            al = 1 + sum(curve)
            eff = (al - 1) / a.k
            tps = 30 * al / (1 + 0.1 * a.k)
            rows.append(row.model_copy(update=dict(
                repeats=3, acceptance_length=al, acceptance_length_min=al - 0.05, acceptance_length_max=al + 0.05,
                per_position=curve, verify_steps=100.0, accepted=100 * (al - 1), draft_tokens=100.0 * a.k,
                draft_efficiency=eff, draft_efficiency_min=eff - 0.01, draft_efficiency_max=eff + 0.01,
                rejected_per_step=a.k - (al - 1), single_stream_tok_s=tps, single_stream_tok_s_min=tps - 1,
                single_stream_tok_s_max=tps + 1, curve_nonincreasing=True)))
        if a.name != failed_arm:
            speed.append(SpeedRow(arm=a.name, concurrency=1, aggregate_tok_s=40.0 + a.k, aggregate_tok_s_min=39.0 + a.k,
                                  aggregate_tok_s_max=41.0 + a.k))
    return rows, speed


def _registration(m):
    return register(m.name, m.path, m.bars, m.spec.baseline, m.prompt_sets, m.prompt_counts, m.spec.prompts_per_class)


def test_verdict_follows_the_measured_values():
    m = load_matrix(REPO / "matrix" / "rehearsal.yaml")
    rows, speed = _synthetic(m, failed_arm="weak-k7")
    verdict = judge(_registration(m), m, rows, speed)
    for v in verdict:
        if v.outcome == "no-data":
            assert v.arm == "weak-k7" or v.baseline_arm == "weak-k7"
            assert "capacity" in v.note and v.margin is None
            continue
        holds = v.measured >= v.threshold if v.op == ">=" else v.measured <= v.threshold
        assert (v.outcome == "pass") == holds, v
    # Relative bars never judge the baseline's own arms; absolute bars judge whoever they select.
    relative = {i for i, b in enumerate(m.bars) if b.relative_to}
    assert not any(v.drafter == "good" for v in verdict if v.bar_index in relative)
    code_k7 = next(v for v in verdict if v.bar_index == 1)
    assert code_k7.arm == "weak-k7" and code_k7.outcome == "no-data"
    # Bar 1 (weak prose at K=4 >= 2.6) fails plainly; the drafter verdict says so.
    first = next(v for v in verdict if v.bar_index == 0)
    assert first.arm == "weak-k4" and first.outcome == "fail" and first.threshold == 2.6
    weak = next(d for d in drafter_verdicts(m, verdict) if d.drafter == "weak")
    assert weak.verdict == "FAILED" and "failed its bars" in weak.sentence()


def test_verdict_suites_pass_real_rows_and_catch_a_flipped_outcome():
    from tasks.record.expectations import validate

    m = load_matrix(REPO / "matrix" / "rehearsal.yaml")
    rows, speed = _synthetic(m, failed_arm="weak-k7")
    verdict = judge(_registration(m), m, rows, speed)
    assert validate("matrix_arms", pd.DataFrame([r.model_dump() for r in rows])).success
    assert validate("matrix_verdict", pd.DataFrame([v.model_dump() for v in verdict])).success
    flipped = [v.model_copy(update={"outcome": "pass"}) if v.outcome == "fail" else v for v in verdict]
    bad = validate("matrix_verdict", pd.DataFrame([v.model_dump() for v in flipped]))
    assert not bad.success and any("margin" in f and "outcome == pass" in f for f in bad.failed)
    rising = [r.model_copy(update={"curve_nonincreasing": False}) if r.arm == "good-k4" else r for r in rows]
    bad = validate("matrix_arms", pd.DataFrame([r.model_dump() for r in rising]))
    assert not bad.success and any("curve_nonincreasing" in f for f in bad.failed)


# --- registration and bar-change detection ----------------------------------------------------

def _fake_run(root: Path, name: str, started: str, reg) -> Path:
    """An earlier run folder as the flow leaves it: the registration inside the manifest."""
    folder = root / f"{started.replace(':', '').replace('-', '')[:15]}Z_matrix_{name}"
    return write_manifest(folder, "matrix", started, matrix=matrix_section(reg.model_dump(mode="json")))


def test_registration_hash_covers_bars_and_prompt_set_bytes(tmp_path):
    data = small_matrix()
    m1 = load_matrix(write_matrix(tmp_path, data))
    r1 = _registration(m1)
    assert r1.recomputed() == (r1.bars_sha256, r1.prompt_sets_sha256)
    assert _registration(load_matrix(write_matrix(tmp_path, data))).sha256 == r1.sha256  # deterministic
    # A bar edit changes the bars hash only.
    data["bars"][0]["value"] = 2.4
    r2 = _registration(load_matrix(write_matrix(tmp_path, data)))
    assert r2.bars_sha256 != r1.bars_sha256 and r2.prompt_sets_sha256 == r1.prompt_sets_sha256
    # Comments and key order are not bars: the same bars hash the same.
    text = (tmp_path / "m.yaml").read_text()
    (tmp_path / "m2.yaml").write_text("# a comment\n" + text)
    assert _registration(load_matrix(tmp_path / "m2.yaml")).bars_sha256 == r2.bars_sha256
    # One byte of a prompt file changes the prompt sets hash.
    prose = tmp_path / "prose.jsonl"
    shutil.copy(PROMPTS / "prose.jsonl", prose)
    data["prompt_sets"]["prose"] = str(prose)
    r3 = _registration(load_matrix(write_matrix(tmp_path, data)))
    assert r3.prompt_sets_sha256 == r2.prompt_sets_sha256
    prose.write_text(prose.read_text().replace("The", "A", 1))
    r4 = _registration(load_matrix(write_matrix(tmp_path, data)))
    assert r4.prompt_sets_sha256 != r3.prompt_sets_sha256 and r4.bars_sha256 == r3.bars_sha256


def test_a_bar_edited_after_a_run_is_detected_on_the_next(tmp_path):
    artifacts = tmp_path / "artifacts"
    data = small_matrix()
    before = _registration(load_matrix(write_matrix(tmp_path, data)))
    _fake_run(artifacts, "aaaaaaaa", "2026-10-01T00:00:00+00:00", before)
    # An unrelated matrix name never counts as an earlier run of this one.
    other = before.model_copy(update={"matrix": "other", "bars_sha256": "0" * 64})
    _fake_run(artifacts, "bbbbbbbb", "2026-10-03T00:00:00+00:00", other)
    same = earlier_run(artifacts, _registration(load_matrix(write_matrix(tmp_path, data))), tmp_path / "now")
    assert isinstance(same, EarlierRun) and same.same_bars and same.same_prompt_sets
    assert same.lines() == [f"bars and prompt sets are the same as in the earlier run {same.run}"]

    data["bars"][0]["value"] = 2.4  # someone lowers the bar after seeing the numbers
    now = _registration(load_matrix(write_matrix(tmp_path, data)))
    changed = earlier_run(artifacts, now, tmp_path / "now")
    assert changed is not None and not changed.same_bars and changed.same_prompt_sets
    assert changed.removed == ["weak: prose acceptance length at K=4 >= 2.6"]
    assert changed.added == ["weak: prose acceptance length at K=4 >= 2.4"]
    assert changed.lines()[0].startswith("BARS CHANGED since the earlier run")
    # The latest earlier run is the one compared with.
    _fake_run(artifacts, "cccccccc", "2026-10-05T00:00:00+00:00", now)
    assert earlier_run(artifacts, now, tmp_path / "now").same_bars


def test_registration_cannot_be_edited():
    m = load_matrix(REPO / "matrix" / "rehearsal.yaml")
    reg = _registration(m)
    with pytest.raises(Exception):
        reg.bars_sha256 = "0" * 64  # type: ignore[misc]
    tampered = json.loads(reg.model_dump_json())
    tampered["bars"][0]["value"] = 1.0
    from tasks.matrix.bars import Registration

    copy = Registration.model_validate(tampered)
    assert copy.recomputed()[0] != copy.bars_sha256  # the flow refuses to judge with such a copy


# --- real runs from the CLI -------------------------------------------------------------------

PORT = 18440  # this file's range: 18440-18459 (arms may move up a port while an earlier one lingers)


def reduced(tmp: Path, **changes) -> dict:
    """Good at K 2 and 4 (the baseline), weak at K 4; two prompts per class, two repeats. The bars
    hold whatever the testbed's exact numbers: good keeps well over 2 tokens per step on code and
    weak far under, at every K."""
    data = small_matrix(
        name="reduced", inventory=str(tmp / "hosts.yaml"),
        arms=[{"drafter": "good", "k": [2, 4]}, {"drafter": "weak", "k": [4]}],
        prompts_per_class=2, max_tokens=32, repeats=2,
        speed={"prompt_set": "prose", "concurrency": [1], "max_tokens": 32, "requests_per_stream": 2},
        bars=[
            {"metric": "acceptance_length", "class": "prose", "drafter": "weak", "k": 4, "op": ">=", "value": 2.6},
            {"metric": "acceptance_length", "class": "code", "k": 4, "relative_to": "baseline", "within": -0.2},
            {"metric": "acceptance_length", "class": "code", "op": ">=", "value": 2.0},
            {"metric": "aggregate_tok_s", "concurrency": 1, "relative_to": "baseline", "op": ">=", "value": -100000},
        ])
    data.update(changes)
    return data


def matrix_inventory(folder: Path, port: int) -> Path:
    """The shipped inventory, the rehearsal lane (the matrix's target) on `port`."""
    inv = shipped_inventory()
    lane = inv["lanes"]["rehearsal"]
    lane["port"] = port
    for ref in ("model", "drafter"):  # the arms pin their own drafters; byte counts are the lane tests' business
        lane[ref].pop("bytes", None)
        lane[ref].pop("sha256", None)
    return write_inventory(folder, inv)


@pytest.fixture(scope="module")
def matrix_runs(tmp_path_factory, llama_bin):
    """Two runs of one matrix name into one artifacts folder: as shipped, then with a bar edited."""
    tmp = tmp_path_factory.mktemp("matrix")
    matrix_inventory(tmp, PORT)
    artifacts = tmp / "artifacts"
    first = run_cli("matrix", str(write_matrix(tmp, reduced(tmp))), "--artifacts", str(artifacts))
    # Someone lowers the candidate's bar after seeing the numbers, and a second drafter arm is
    # booted with one server slot while the speed rows ask for two: its capacity gate fails.
    edited = reduced(tmp, arms=[{"drafter": "good", "k": [2, 4]},
                                {"drafter": "weak", "k": 4, "name": "weak-k4-one-slot", "flags": ["--parallel", "1"]}],
                     speed={"prompt_set": "prose", "concurrency": [1, 2], "max_tokens": 32, "requests_per_stream": 1})
    edited["bars"][0]["value"] = 1.2
    second = run_cli("matrix", str(write_matrix(tmp, edited)), "--artifacts", str(artifacts))
    return first, second


def test_matrix_runs_every_arm_fresh_and_publishes_a_negative_verdict(matrix_runs):
    result, _ = matrix_runs
    assert result.returncode == 0, result.stdout + result.stderr  # the matrix ran; a failed bar is a verdict
    folder = run_folder_of(result)
    assert folder.name.split("_")[1] == "matrix"
    assert "drafter weak: FAILED" in result.stderr and "drafter good: PASSED" in result.stderr
    m = manifest_of(folder)
    facts = m["flow"]["matrix"]
    assert list(m["lanes"]) == ["good-k2", "good-k4", "weak-k4", "no-speculation"]
    # The arm every speculation verdict needs: the same target, no drafter, the same speed rows.
    plain = m["lanes"]["no-speculation"]
    assert plain["status"] == "passed", plain
    assert "--model-draft" not in plain["launch_command"] and "--spec" not in plain["launch_command"]
    assert isinstance(facts["against_no_speculation"], list)
    registered = facts["registration"]["registered_at"]
    spans = []
    for name, k, drafter in (("good-k2", 2, "good"), ("good-k4", 4, "good"), ("weak-k4", 4, "weak")):
        lane = m["lanes"][name]
        assert lane["status"] == "passed", lane
        # One fresh boot per arm: its own launch command, boot log and boot facts.
        assert f"--spec-draft-n-max {k}" in lane["launch_command"]
        assert f"drafter-{drafter}-f16.gguf" in lane["launch_command"]
        assert lane["boot_seconds"] > 0 and lane["boot_facts"]["draft_model_loaded"]
        assert any(a["path"] == f"{name}/boot.log" for a in m["artifacts"])
        arm = facts["arms"][name]
        assert arm["started_at"] > registered  # bars registered before any arm booted
        assert arm["host_lock"]["limit"] == "gpu:localhost" and arm["host_lock"]["acquired_at"]
        spans.append((arm["started_at"], arm["finished_at"]))
    assert all(a[1] <= b[0] for a, b in zip(spans, spans[1:]))  # one at a time
    assert facts["registration_sha256"] == facts["registration"]["sha256"] and facts["earlier_run"] is None
    assert facts["verdict"]["complete"] and facts["verdict"]["drafters"]["weak"]["verdict"] == "FAILED"
    assert no_llama_server_left(range(PORT, PORT + 20))


def test_matrix_tables_curves_and_verdict_agree(matrix_runs):
    result, _ = matrix_runs
    folder = run_folder_of(result)
    m = manifest_of(folder)
    kinds = {a["path"]: a for a in m["artifacts"]}
    for rel in ("matrix/matrix_arms.parquet", "matrix/matrix_verdict.parquet"):
        assert kinds[rel]["validation"] == "passed", kinds[rel]
    for rel in ("matrix/per_position.png", "matrix/k_sweep.png", "registration.json", "report.md"):
        assert rel in kinds and (folder / rel).stat().st_size > 0
    arms = pd.read_parquet(folder / "matrix" / "matrix_arms.parquet")
    assert set(arms.prompt_class) == {"prose", "code"} and len(arms) == 6
    for row in arms.itertuples():
        curve = list(row.per_position)
        assert len(curve) == row.k and all(a >= b for a, b in zip(curve, curve[1:])), row
        assert 1.0 <= row.acceptance_length <= row.k + 1 and 0 < row.draft_efficiency <= 1
    verdict = pd.read_parquet(folder / "matrix" / "matrix_verdict.parquet")
    assert set(verdict.bars_sha256) == {m["flow"]["matrix"]["registration"]["bars_sha256"]}
    for v in verdict.itertuples():
        assert v.outcome == ("pass" if v.measured >= v.threshold else "fail"), v
        if pd.notna(v.baseline_arm):
            assert v.threshold == pytest.approx(v.baseline_value + (-0.2 if v.bar_index == 1 else -100000))
    by = {(v.bar_index, v.arm): v.outcome for v in verdict.itertuples()}
    assert by[(0, "weak-k4")] == "fail" and by[(1, "weak-k4")] == "fail" and by[(3, "weak-k4")] == "pass"
    assert {a for (i, a) in by if i == 1} == {"weak-k4"}  # relative bars never judge the baseline itself
    report = (folder / "report.md").read_text()
    assert "## Bars as registered" in report and m["flow"]["matrix"]["registration_sha256"] in report
    assert "1. weak: prose acceptance length at K=4 >= 2.6" in report
    assert "Drafter **weak** (revision testbed-weak) **failed" in report
    assert "## The K trade" in report and "per_position.png" in report
    audit = run_cli("verify", str(folder))
    assert audit.returncode == 0, audit.stdout  # every file of the run is in the manifest with its sha256


def test_rerun_with_an_edited_bar_says_so_and_a_failed_gate_does_not_stop_the_matrix(matrix_runs):
    first, second = matrix_runs
    assert second.returncode == 1, second.stdout + second.stderr  # incomplete: an arm failed its gate
    folder, earlier = run_folder_of(second), run_folder_of(first)
    m = manifest_of(folder)
    change = m["flow"]["matrix"]["earlier_run"]
    assert change["run"] == earlier.name and not change["same_bars"] and change["same_prompt_sets"]
    assert change["removed"] == ["weak: prose acceptance length at K=4 >= 2.6"]
    assert change["added"] == ["weak: prose acceptance length at K=4 >= 1.2"]
    assert "BARS CHANGED" in second.stderr
    report = (folder / "report.md").read_text()
    assert f"BARS CHANGED since the earlier run {earlier.name}" in report
    assert "removed: weak: prose acceptance length at K=4 >= 2.6" in report
    # The gate failure is the arm's, with its reason; the other arms were measured anyway.
    bad = m["lanes"]["weak-k4-one-slot"]
    assert bad["status"] == "failed" and bad["stage"] == "boot gates" and "= 1, required >= 2" in bad["reason"]
    assert m["lanes"]["good-k2"]["status"] == "passed" and m["lanes"]["good-k4"]["status"] == "passed"
    verdict = pd.read_parquet(folder / "matrix" / "matrix_verdict.parquet")
    mine = verdict[verdict.arm == "weak-k4-one-slot"]
    assert len(mine) == 4 and set(mine.outcome) == {"no-data"}
    assert all("capacity" in note for note in mine.note)
    assert "**Incomplete matrix**" in report and "| weak-k4-one-slot |" in report
    assert no_llama_server_left(range(PORT, PORT + 20))


@pytest.mark.parametrize("sig", ["SIGINT", "SIGTERM"])
def test_ctrl_c_mid_arm_stops_the_matrix_like_nightly(tmp_path, llama_bin, sig):
    """Ctrl-C to `lanebench matrix`'s process group, or SIGTERM to the process alone, mid arm
    (flows/cli/__init__.py -> run_flow): exit 130 naming the signal, the arm's server torn down,
    the run folder marked interrupted with the arms never started said so, verify passes, no
    verdict."""
    matrix_inventory(tmp_path, PORT + 10)
    artifacts = tmp_path / "artifacts"
    data = reduced(tmp_path)
    result, sent = interrupt_cli("matrix", str(write_matrix(tmp_path, data)), "--artifacts", str(artifacts),
                                 when=lambda: any(artifacts.glob("*_matrix_*/*/requests.jsonl")),  # first arm measuring
                                 signal_name=sig)
    out, err = result.stdout, result.stderr
    assert sent, "the first arm never measured: " + out[-500:] + err[-1500:]
    assert result.returncode == 130, out + err
    assert f"matrix interrupted by {sig}" in out + err and "Traceback" not in err, out + err
    folder = run_folder_of(result)
    m = manifest_of(folder)
    assert m["flow"]["status"] == "interrupted", m["flow"]
    statuses = {name: lane["status"] for name, lane in m["lanes"].items()}
    assert "interrupted" in statuses.values() and "passed" not in statuses.values(), statuses
    assert m["flow"]["matrix"]["verdict"] is None
    assert run_cli("verify", str(folder)).returncode == 0
    assert all(llama_server_pid(p) is None for p in range(PORT + 10, PORT + 20))

