"""The benches the field reports ran: prefill ladder, accuracy eval with truncation accounted for,
capacity plan, and the concurrency curve past the cap, labelled as a queue.

One nightly through the CLI on real llama-servers backs the end-to-end assertions: the rehearsal
lane as shipped (its speed stages trimmed), and a second lane with two slots that declares a
queueing level past them and asks the accuracy eval at a cap far too low for it.
"""

from __future__ import annotations

import copy
import json

import pandas as pd
import pytest

from conftest import manifest_of, no_llama_server_left, run_cli, run_folder_of, shipped_inventory, write_inventory
from tasks.correctness.accuracy import AccuracyAttempt, extract, in_words, score
from tasks.engines.facts import BootFacts
from tasks.inventory.base import ConfigError
from tasks.inventory.load import load_inventory
from tasks.engines import engine_for
from tasks.inventory.models import AccuracyPlan, CapacityGate, Lane
from tasks.stages.capacity import capacity_plan, context_per_user
from tasks.stages.gates import capacity_gate

PORTS = (18561, 18562)


# --- pure parts: answer reading, the five measures, the capacity trade, the gate exception ----------


def test_the_chosen_letter_is_read_from_the_reply():
    choices = ["celsius", "fahrenheit", "kelvin", "rankine"]
    assert extract("Let me think.\nAnswer: C", choices) == "C"
    assert extract("The answer is (B).", choices) == "B"
    assert extract("answer: a then Answer: D", choices) == "D"  # the last explicit answer; lower-case 'a' is a word
    assert extract(" (A) ", choices) == "A"
    assert extract('<tool_call>{"unit": "fahrenheit"}</tool_call>', choices) == "B"  # names exactly one choice
    assert extract("celsius or fahrenheit", choices) is None  # two choices named: no answer
    assert extract("Answer: E", choices) is None  # not a choice


def _attempts(spec: list[tuple[bool, bool]], which: str = "first") -> list[AccuracyAttempt]:
    return [AccuracyAttempt(lane="l", index=i, attempt=which, max_tokens=8, nonce="n", ok=True,
                            finish_reason="length" if cut else "stop", truncated=cut, chosen="A" if right else None,
                            answer="A", right=right, completion_tokens=8, prompt_tokens=20, seconds=0.1, reply="",
                            reasoning_chars=0)
            for i, (right, cut) in enumerate(spec)]


def test_the_five_measures_merge_the_reask_by_question_index():
    plan = AccuracyPlan(file="x", max_tokens=8, reask_max_tokens=64)
    # 10 questions: 2 right, 6 cut off at 8; the re-ask finishes 4 of the 6 (3 right), 2 stay cut off.
    first = _attempts([(True, False), (True, False), (False, False), (False, False)] + [(False, True)] * 6)
    reask = {a.index + 4: a.model_copy(update={"index": a.index + 4, "attempt": "reask"})
             for a in _attempts([(True, False)] * 3 + [(False, False)] + [(False, True)] * 2, "reask")}
    rows = {r.measure: r for r in score("l", plan, first, reask)}
    assert (rows["raw"].count, rows["raw"].of) == (2, 10)
    assert (rows["truncated_share"].count, rows["truncated_share"].max_tokens) == (6, 8)
    assert (rows["floor"].count, rows["floor"].of, rows["floor"].max_tokens) == (5, 10, 64)
    assert rows["still_truncated_share"].count == 2
    assert (rows["finished_right"].count, rows["finished_right"].of) == (5, 8)
    for r in rows.values():  # Wilson intervals hold their value
        assert r.ci_low <= r.value <= r.ci_high
    words = in_words(list(rows.values()))
    assert words.startswith("TRUNCATION DOMINATES: 6 of 10 answers hit max_tokens 8")
    assert "raw 2/10 = 20%" in words and "cut off at that cap" in words
    calm = score("l", plan, _attempts([(True, False)] * 3 + [(False, True)]), {})
    assert not in_words(calm).startswith("TRUNCATION") and "1/4 = 25%" in in_words(calm)


def _lane(**bench) -> Lane:
    lane = copy.deepcopy(shipped_inventory()["lanes"]["rehearsal"])
    lane["bench"] |= bench
    return Lane.model_validate(lane)


def test_the_seeds_trade_from_a_shared_pool():
    # The seeds' batch lane: 640 state slots left a 201K-token KV pool on a 1M context.
    facts = BootFacts(max_running_requests=128, context_per_slot=1_048_576, extra={"max_total_num_tokens": 201_000})
    assert context_per_user(48, facts, 1_048_576) == 4187  # "about 4K tokens per user at 48"
    assert context_per_user(128, facts, 1_048_576) == 1570  # "or 1.5K at 128"
    assert context_per_user(129, facts, 1_048_576) == 0  # past the cap: a queue, no seat
    lane = _lane(decode={"concurrency": [1, 48, 128], "max_tokens": 384, "prompts": "p.jsonl"})
    rows, check = capacity_plan.fn("gb300", lane, facts, typical=6000)
    assert [r.users for r in rows] == [1, 48, 128]
    assert not check.fits
    assert "declared concurrency 128 x typical 6000 tokens" in check.warning and "201000" in check.warning


def test_a_per_slot_pool_holds_the_slot_context_and_flags_a_long_typical_request():
    facts = BootFacts(max_running_requests=8, context_per_slot=512)
    rows, check = capacity_plan.fn("rehearsal", _lane(), facts, typical=300)
    assert check.fits and {r.context_per_user for r in rows} == {512} and rows[0].pool_tokens == 4096
    _, check = capacity_plan.fn("rehearsal", _lane(), facts, typical=600)
    assert not check.fits and "600 tokens" in check.warning and "512 tokens per user" in check.warning


def test_the_capacity_gate_lets_exactly_the_declared_queue_levels_through():
    facts = BootFacts(max_running_requests=2, context_per_slot=512)
    queued = _lane(decode={"concurrency": [1, 2, 4], "prompts": "p.jsonl", "beyond_cap": {"queue": [4]}})
    result = capacity_gate.fn(CapacityGate(kind="capacity"), queued, facts)
    assert result.passed and "beyond_cap queue levels [4]" in result.detail
    undeclared = _lane(decode={"concurrency": [1, 2, 4, 8], "prompts": "p.jsonl", "beyond_cap": {"queue": [4]}})
    assert not capacity_gate.fn(CapacityGate(kind="capacity"), undeclared, facts).passed


def test_bad_bench_declarations_are_config_errors(tmp_path):
    inv = shipped_inventory()
    inv["lanes"]["rehearsal"]["bench"]["decode"]["beyond_cap"] = {"queue": [16]}
    with pytest.raises(ConfigError, match="beyond_cap.queue names levels \\[16\\] that are not in concurrency"):
        load_inventory(write_inventory(tmp_path / "a", inv), engine_for)
    inv = shipped_inventory()
    inv["lanes"]["rehearsal"]["bench"]["accuracy"]["reask_max_tokens"] = 50
    with pytest.raises(ConfigError, match="reask_max_tokens \\(50\\) must be above max_tokens \\(88\\)"):
        load_inventory(write_inventory(tmp_path / "b", inv), engine_for)
    inv = shipped_inventory()
    inv["lanes"]["rehearsal"]["bench"]["accuracy"]["file"] = "absent.jsonl"
    result = run_cli("nightly", "--hosts", str(write_inventory(tmp_path / "c", inv)), timeout=120)
    assert result.returncode == 2 and "lanes.rehearsal.bench.accuracy.file" in result.stderr, result.stderr


@pytest.mark.parametrize("kind", ["prefill", "accuracy", "capacity", "queueing"])
def test_suites_round_trip_and_say_why(kind):
    import great_expectations as gx

    from tasks.record.expectations import SUITES_DIR

    from tasks.record.kinds import kind as artifact_kind

    raw = json.loads((SUITES_DIR / f"{kind}.json").read_text())
    assert gx.ExpectationSuite(**raw).to_json_dict() == raw
    assert all(e["meta"]["why"] for e in raw["expectations"])
    (schema,) = [e for e in raw["expectations"] if e["type"] == "expect_table_columns_to_match_set"]
    assert schema["kwargs"]["column_set"] == list(artifact_kind(kind).model().model_fields)


def test_a_raw_score_without_its_truncated_share_is_quarantined():
    from tasks.record.expectations import validate

    plan = AccuracyPlan(file="x", max_tokens=8, reask_max_tokens=64)
    rows = [r.model_dump() for r in score("l", plan, _attempts([(True, False), (False, True)]), {})]
    assert validate("accuracy", pd.DataFrame(rows)).success
    alone = validate("accuracy", pd.DataFrame([r for r in rows if r["measure"] != "truncated_share"]))
    assert not alone.success and any("row_count" in f for f in alone.failed)
    outside = validate("accuracy", pd.DataFrame([r | {"ci_high": 0.1} if r["measure"] == "raw" else r for r in rows]))
    assert not outside.success and any("ci_high" in f for f in outside.failed)


# --- one nightly on real servers ---------------------------------------------------------------------


@pytest.fixture(scope="module")
def nightly(tmp_path_factory, llama_bin):
    inv = shipped_inventory()
    rehearsal = inv["lanes"]["rehearsal"]
    rehearsal["port"] = PORTS[0]
    rehearsal["bench"] |= {"repeats": 1}
    rehearsal["bench"]["decode"]["concurrency"] = [1, 2]
    rehearsal["bench"].pop("acceptance")
    rehearsal.pop("correctness")
    queueing = copy.deepcopy(rehearsal)
    queueing |= {"port": PORTS[1], "slots": 2, "flags": [], "gates": [{"kind": "capacity"}]}
    for key in ("drafter", "speculative"):
        queueing.pop(key)
    queueing["bench"] = {
        "repeats": 1,
        "decode": {"concurrency": [1, 2, 4], "max_tokens": 16, "requests_per_stream": 1,
                   "prompts": "testbed/prompts/prose.jsonl", "beyond_cap": {"queue": [4]}},
        # A cap far too low for the eval: nearly every answer is cut off before it names a choice.
        "accuracy": rehearsal["bench"]["accuracy"] | {"max_tokens": 8, "reask_max_tokens": 192},
        "capacity": {},
    }
    inv["lanes"]["past-cap"] = queueing
    tmp = tmp_path_factory.mktemp("benches")
    result = run_cli("nightly", "--hosts", str(write_inventory(tmp, inv)), "--artifacts", str(tmp / "artifacts"))
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-4000:]
    folder = run_folder_of(result)
    return folder, manifest_of(folder), (folder / "report.md").read_text(), tmp / "artifacts"


def _section(report: str, lane: str) -> str:
    """One lane's part of report.md: from its heading to the next lane's."""
    return report.split(f"\n## {lane}\n", 1)[1].split("\n## ", 1)[0]


def _table(folder, lane: str, kind: str) -> pd.DataFrame:
    return pd.read_parquet(folder / lane / f"{kind}.parquet")


def test_every_new_table_passes_its_suite(nightly):
    folder, m, _, _ = nightly
    validated = {(a["lane"], a["kind"]): a["validation"] for a in m["artifacts"]}
    for lane, kind in [("rehearsal", "prefill"), ("rehearsal", "accuracy"), ("rehearsal", "capacity"),
                       ("past-cap", "queueing"), ("past-cap", "decode"), ("past-cap", "accuracy"),
                       ("past-cap", "capacity")]:
        assert validated[(lane, kind)] == "passed", (lane, kind)
    assert all(lane["status"] == "passed" for lane in m["lanes"].values())
    assert no_llama_server_left(PORTS[0]) and no_llama_server_left(PORTS[1])


def test_prefill_ladder_cold_and_warm_apart_and_a_rung_too_long_skipped(nightly):
    folder, m, _, _ = nightly
    ladder = _table(folder, "rehearsal", "prefill").set_index("rung")
    assert list(ladder.index) == [32, 128, 384, 1024]
    measured = ladder[ladder.status == "measured"]
    assert list(measured.index) == [32, 128, 384]
    assert (measured.prompt_tokens <= measured.index + 2).all() and (measured.prompt_tokens >= 0.8 * measured.index).all()
    assert (measured.prefill_tok_s > 0).all() and measured.warm_ttft_s.notna().all()
    assert ladder.loc[1024, "status"] == "skipped" and "512 tokens per slot the server resolved" in ladder.loc[1024, "reason"]
    raw = pd.read_json(folder / "rehearsal" / "prefill.jsonl", lines=True)
    # One cold and one warm request per measured rung, sharing one nonce; rungs never share one.
    assert sorted(raw.groupby("rung").hit.apply(sorted).tolist()) == [["cold", "warm"]] * 3
    assert (raw.groupby("rung").nonce.nunique() == 1).all() and raw.nonce.nunique() == 3
    assert any("rung 1024 skipped" in w for w in m["lanes"]["rehearsal"]["warnings"])


def test_accuracy_keeps_raw_beside_truncated_share_floor_and_finished(nightly):
    folder, _, report, _ = nightly
    acc = _table(folder, "rehearsal", "accuracy").set_index("measure")
    assert set(acc.index) == {"raw", "truncated_share", "floor", "still_truncated_share", "finished_right"}
    assert acc.loc["raw", "of"] == 12 and acc.loc["floor", "max_tokens"] == 192
    assert acc.loc["truncated_share", "value"] <= 0.5 and acc.loc["floor", "count"] >= 6  # the testbed answers
    raw = pd.read_json(folder / "rehearsal" / "accuracy.jsonl", lines=True)
    first, reask = raw[raw.attempt == "first"], raw[raw.attempt == "reask"]
    assert len(first) == 12 and set(reask["index"]) == set(first[first.truncated]["index"])
    assert "### Accuracy eval (truncation accounted for)" in report


def test_a_cap_too_low_makes_truncation_dominate_and_the_report_says_so(nightly):
    folder, m, report, _ = nightly
    acc = _table(folder, "past-cap", "accuracy").set_index("measure")
    assert acc.loc["truncated_share", "value"] > 0.5 and acc.loc["truncated_share", "max_tokens"] == 8
    assert acc.loc["floor", "value"] > acc.loc["raw", "value"]  # the re-ask at 192 recovers what the cap hid
    section = _section(report, "past-cap")
    assert "TRUNCATION DOMINATES" in section and "the raw score is a truncation score, not the model's" in section
    assert any(w.startswith("accuracy eval: TRUNCATION DOMINATES") for w in m["lanes"]["past-cap"]["warnings"])


def test_capacity_plan_is_in_the_manifest_and_report(nightly):
    folder, m, report, _ = nightly
    check = m["lanes"]["rehearsal"]["capacity"]
    assert check["pool_tokens"] == 4096 and check["context_per_user"] == 512 and check["fits"]
    plan = _table(folder, "rehearsal", "capacity")
    assert set(plan.users) >= {1, 2, 8} and (plan.context_per_user == 512).all()
    assert "### Capacity plan: bytes per seat" in report and "640 state slots" in report


def test_the_level_past_the_cap_is_labelled_queueing_and_never_judged(nightly):
    folder, m, report, artifacts = nightly
    gate = m["lanes"]["past-cap"]["gates"][0]
    assert gate["passed"] and "beyond_cap queue levels [4] run as queueing" in gate["detail"]
    decode = _table(folder, "past-cap", "decode").set_index("concurrency")
    assert decode.regime.to_dict() == {1: "measured", 2: "measured", 4: "queueing"}
    queue = _table(folder, "past-cap", "queueing").iloc[0]
    assert queue.concurrency == 4 and queue.beyond_cap == 2 and queue.queue_gauge == "llamacpp:requests_deferred"
    assert 0 <= queue.queue_wait_p50_s <= queue.ttft_p50_s
    section = _section(report, "past-cap")
    assert "**queueing**" in section and "### Queueing levels" in section
    from tasks.record.history import open_index

    con = open_index(artifacts)
    metrics = set(con.execute("SELECT metric FROM metrics WHERE lane = 'past-cap'").df().metric)
    assert {"tok_s@c1", "tok_s@c2"} <= metrics and "tok_s@c4" not in metrics and "ttft_p95_s@c4" not in metrics
    rehearsal = set(con.execute("SELECT metric FROM metrics WHERE lane = 'rehearsal' AND headline").df().metric)
    assert {"accuracy_floor", "accuracy_truncated_share"} <= rehearsal
    kept = set(con.execute("SELECT metric FROM metrics WHERE lane = 'rehearsal' AND NOT headline").df().metric)
    assert {"prefill_tok_s@r32", "prefill_tok_s@r384"} <= kept  # history, not a night-to-night verdict
    con.close()
    regression = _table(folder, "past-cap", "regression")
    assert not regression.metric.str.endswith("@c4").any()


def test_report_shows_the_sections_and_plots(nightly):
    folder, m, report, _ = nightly
    for heading in ("### Prefill ladder", "### Capacity plan", "### Accuracy eval", "### Queueing levels"):
        assert heading in report
    plots = {a["path"] for a in m["artifacts"] if a["kind"] == "plot"}
    for rel in ("rehearsal/prefill.png", "rehearsal/accuracy.png", "rehearsal/capacity.png",
                "past-cap/concurrency.png", "past-cap/accuracy.png"):
        assert rel in plots and (folder / rel).stat().st_size > 0 and f"]({rel})" in report
    assert json.loads((folder / "manifest.json").read_text())["lanes"]["rehearsal"]["capacity"]
