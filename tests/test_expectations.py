"""The GX gate: valid artifacts pass, and each broken invariant fails by name."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from tasks.record.expectations import SUITES_DIR, _get_engine, derive, validate
from tasks.record.kinds import KINDS
from tasks.wire.records import RequestRecord
from tasks.record.rows import AcceptanceRow, DecodeRow, WarmupRow

RECORDS = {"requests": RequestRecord, "warmup": WarmupRow, "decode": DecodeRow, "acceptance": AcceptanceRow}


def _request(i: int, **kw: object) -> dict:
    row = RequestRecord(
        lane="l1", stage="decode", repeat=1, concurrency=2, prompt_class="chat", prompt_id=f"p{i}",
        nonce=f"n{i}", max_tokens=64, ok=True, http_status=200, prompt_tokens=20, output_tokens=64,
        finish_reason="length", started_at=1.7e9 + i, ttft_s=0.05, e2el_s=1.2, itl_p50_s=0.018, chunks=64,
        spec={"draft_n": 40.0, "draft_n_accepted": 30.0},
    ).model_dump()
    return row | kw


def _valid(kind: str) -> pd.DataFrame:
    """A small artifact of each kind that satisfies every invariant."""
    if kind == "requests":
        rows = [_request(0), _request(1, stage="warmup", repeat=0), _request(2, output_tokens=17, finish_reason="stop")]
    elif kind == "warmup":
        rows = [
            WarmupRow(lane="l1", concurrency=c, size_class=s, first_hit_ttft_s=0.9, first_hit_e2el_s=3.0,
                      steady_ttft_s=0.05, steady_e2el_s=1.1, first_hit_cost_s=1.9).model_dump()
            for c in (1, 4) for s in ("short", "long")
        ]
    elif kind == "decode":
        rows = [
            DecodeRow(lane="l1", concurrency=c, repeats=3, aggregate_tok_s=50.0 * c, aggregate_tok_s_min=48.0 * c,
                      aggregate_tok_s_max=51.0 * c, aggregate_spread_pct=6.0, per_user_tok_s=50.0, ttft_p50_s=0.05,
                      ttft_p95_s=0.08, itl_p50_s=0.02, requests=6 * c, failed_requests=0).model_dump()
            for c in (1, 4)
        ]
    else:
        rows = [
            AcceptanceRow(lane="l1", prompt_class=pc, k=3, repeats=2, acceptance_length=2.1, acceptance_length_min=2.0,
                          acceptance_length_max=2.2, verify_steps=100.0, accepted=110.0, per_position=[0.6, 0.3, 0.2],
                          source="counters").model_dump()
            for pc in ("code", "chat")
        ]
    return pd.DataFrame(rows)


def _set(column: str, value: object, row: int = 0) -> Callable[[pd.DataFrame], pd.DataFrame]:
    def mutate(df: pd.DataFrame) -> pd.DataFrame:
        df = df.copy()
        df[column] = df[column].astype(object)
        df.at[row, column] = value
        return df

    return mutate


def _rows(**kw: object) -> Callable[[pd.DataFrame], pd.DataFrame]:
    def mutate(df: pd.DataFrame) -> pd.DataFrame:
        df = df.copy()
        for column, value in kw.items():
            df = _set(column, value)(df)
        return df

    return mutate


def _dup(df: pd.DataFrame) -> pd.DataFrame:
    return pd.concat([df, df.iloc[[0]]], ignore_index=True)


@pytest.mark.parametrize("kind", list(RECORDS))  # suites of later flows are tested beside them
def test_valid_artifact_passes(kind: str) -> None:
    v = validate(kind, _valid(kind))
    assert v.failed == [] and v.success, v.failed
    assert v.evaluated == len(json.loads((SUITES_DIR / f"{kind}.json").read_text())["expectations"])
    json.dumps(v.result)  # saveable beside the artifact


BROKEN = [
    # acceptance
    ("acceptance", _set("per_position", [0.3, 0.6, 0.2]), "expect_column_values_to_be_in_set(per_position_nonincreasing)"),
    ("acceptance", _set("per_position", "[0.2, 0.3, 0.1]"), "per_position='[0.2, 0.3, 0.1]'"),
    ("acceptance", _set("per_position", [1.2, 0.3, 0.2]), "expect_column_values_to_be_between(per_position_max)"),
    ("acceptance", _set("per_position", [0.6, 0.3, -0.1]), "expect_column_values_to_be_between(per_position_min)"),
    ("acceptance", _set("per_position", [0.6, 0.3]), "expect_column_pair_values_to_be_equal(per_position_len, k)"),
    ("acceptance", _set("per_position", "not a list"), "expect_column_pair_values_to_be_equal(per_position_len, k)"),
    ("acceptance", _set("per_position", [0.6, 0.3, 0.2, 0.1]), "expect_column_pair_values_to_be_equal(per_position_len, k)"),
    ("acceptance", _rows(acceptance_length=4.5, acceptance_length_max=4.6),
     "expect_column_pair_values_a_to_be_greater_than_b(k_plus_1, acceptance_length)"),
    ("acceptance", _rows(acceptance_length=0.9, acceptance_length_min=0.8),
     "expect_column_values_to_be_between(acceptance_length)"),
    ("acceptance", _set("acceptance_length_min", 2.15),
     "expect_column_pair_values_a_to_be_greater_than_b(acceptance_length, acceptance_length_min)"),
    ("acceptance", _set("acceptance_length_max", 2.05),
     "expect_column_pair_values_a_to_be_greater_than_b(acceptance_length_max, acceptance_length)"),
    ("acceptance", _set("verify_steps", 0.0), "expect_column_values_to_be_between(verify_steps)"),
    ("acceptance", _set("verify_steps", None), "expect_column_values_to_not_be_null(verify_steps)"),
    ("acceptance", _set("accepted", -1.0), "expect_column_values_to_be_between(accepted)"),
    ("acceptance", _set("prompt_class", None), "expect_column_values_to_not_be_null(prompt_class)"),
    ("acceptance", _dup, "expect_compound_columns_to_be_unique(lane, prompt_class, k)"),
    # decode
    ("decode", _set("ttft_p95_s", 0.04), "expect_column_pair_values_a_to_be_greater_than_b(ttft_p95_s, ttft_p50_s)"),
    ("decode", _set("failed_requests", 1), "expect_column_values_to_be_between(failed_requests)"),
    ("decode", _rows(aggregate_tok_s=0.0, aggregate_tok_s_min=0.0), "expect_column_values_to_be_between(aggregate_tok_s)"),
    ("decode", _set("aggregate_tok_s", 47.0),
     "expect_column_pair_values_a_to_be_greater_than_b(aggregate_tok_s, aggregate_tok_s_min)"),
    ("decode", _set("aggregate_tok_s", 52.0),
     "expect_column_pair_values_a_to_be_greater_than_b(aggregate_tok_s_max, aggregate_tok_s)"),
    ("decode", _set("per_user_tok_s", 0.0), "expect_column_values_to_be_between(per_user_tok_s)"),
    ("decode", _set("concurrency", 0), "expect_column_values_to_be_between(concurrency)"),
    ("decode", _dup, "expect_compound_columns_to_be_unique(lane, concurrency)"),
    # requests
    ("requests", _rows(ok=False, error="HTTP 500"), "expect_column_values_to_be_in_set(ok)"),
    ("requests", _set("error", "connection reset"), "expect_column_values_to_be_null(error)"),
    ("requests", _rows(output_tokens=40, finish_reason="length"),
     "expect_column_pair_values_to_be_equal(output_tokens, max_tokens): 1/2 rows unexpected where (finish_reason != stop OR finish_reason IS NULL)"),
    ("requests", _rows(output_tokens=40, finish_reason=None), "expect_column_pair_values_to_be_equal(output_tokens, max_tokens)"),
    ("requests", _set("ttft_s", 1.5), "expect_column_pair_values_a_to_be_greater_than_b(e2el_s, ttft_s)"),
    ("requests", _set("ttft_s", None), "expect_column_values_to_not_be_null(ttft_s)"),
    ("requests", _set("e2el_s", float("nan")), "expect_column_values_to_not_be_null(e2el_s)"),
    ("requests", _rows(output_tokens=0, finish_reason="stop"), "expect_column_values_to_be_between(output_tokens)"),
    ("requests", _set("output_tokens", 65), "expect_column_pair_values_a_to_be_greater_than_b(max_tokens, output_tokens)"),
    ("requests", _rows(nonce="n1", prompt_id="p1"), "expect_compound_columns_to_be_unique(lane, nonce, prompt_id)"),
    ("requests", lambda df: df.drop(columns=["finish_reason"]), "missing columns ['finish_reason']"),
    # warmup
    *[("warmup", _set(c, 0.0), f"expect_column_values_to_be_between({c})")
      for c in ("first_hit_ttft_s", "first_hit_e2el_s", "steady_ttft_s", "steady_e2el_s")],
    ("warmup", _set("steady_ttft_s", 2.0), "expect_column_pair_values_a_to_be_greater_than_b(steady_e2el_s, steady_ttft_s)"),
    ("warmup", _set("size_class", "long"), "expect_compound_columns_to_be_unique(lane, concurrency, size_class)"),
]


@pytest.mark.parametrize(("kind", "mutate", "expected"), BROKEN, ids=[f"{k}-{e[:70]}" for k, _, e in BROKEN])
def test_broken_invariant_fails_by_name(kind: str, mutate: Callable[[pd.DataFrame], pd.DataFrame], expected: str) -> None:
    v = validate(kind, mutate(_valid(kind)))
    assert not v.success
    assert any(expected in line for line in v.failed), v.failed


def test_failure_line_points_at_the_row() -> None:
    v = validate("requests", _rows(output_tokens=40, finish_reason="length")(_valid("requests")))
    (line,) = [x for x in v.failed if "expect_column_pair_values_to_be_equal" in x]
    assert "prompt_id='p0'" in line and "output_tokens=40" in line and "max_tokens=64" in line and "finish_reason='length'" in line


def test_accepted_shapes_are_valid() -> None:
    """Stopped-early requests, JSON-string fields, array curves, an empty curve, a nonce shared by two prompts."""
    df = _rows(nonce="n1")(_valid("requests"))
    df["spec"] = [json.dumps(s) for s in df["spec"]]
    assert validate("requests", df).success
    acc = _valid("acceptance")
    acc["per_position"] = [json.dumps(acc.at[0, "per_position"]), np.array(acc.at[1, "per_position"])]
    assert validate("acceptance", acc).success
    v = validate("acceptance", _set("per_position", [])(_valid("acceptance")))
    assert v.success, v.failed


@pytest.mark.parametrize("kind", list(RECORDS))  # suites of later flows are tested beside them
def test_empty_frame_fails_without_crashing(kind: str) -> None:
    v = validate(kind, _valid(kind).iloc[0:0])
    assert not v.success
    assert any(line.startswith("expect_table_row_count_to_be_between") for line in v.failed), v.failed
    assert not validate(kind, pd.DataFrame()).success


def test_unknown_kind_raises() -> None:
    with pytest.raises(ValueError, match="unknown artifact kind"):
        validate("latency", _valid("decode"))


@pytest.mark.parametrize("kind", list(RECORDS))  # suites of later flows are tested beside them
def test_suite_json_round_trips_and_names_every_record_field(kind: str) -> None:
    import great_expectations as gx

    raw = json.loads((SUITES_DIR / f"{kind}.json").read_text())
    assert gx.ExpectationSuite(**raw).to_json_dict() == raw
    (schema,) = [e for e in raw["expectations"] if e["type"] == "expect_table_columns_to_match_set"]
    assert schema["kwargs"]["column_set"] == list(RECORDS[kind].model_fields)
    assert all(e["meta"].get("why") for e in raw["expectations"])


def test_derive_leaves_the_input_alone() -> None:
    df = _valid("acceptance")
    out = derive("acceptance", df)
    assert "per_position_nonincreasing" in out and "per_position_nonincreasing" not in df
    assert out["k_plus_1"].tolist() == [4, 4]


def test_the_suite_file_is_what_catches_it(tmp_path: Path) -> None:
    """Drop one expectation from a copy of the suite: the broken frame then passes there."""
    raw = json.loads((SUITES_DIR / "acceptance.json").read_text())
    raw["expectations"] = [e for e in raw["expectations"] if e["kwargs"].get("column") != "per_position_nonincreasing"]
    (tmp_path / "acceptance.json").write_text(json.dumps(raw))
    rising = _set("per_position", [0.3, 0.6, 0.2])(_valid("acceptance"))
    assert validate("acceptance", rising, suites_dir=tmp_path).success
    assert not validate("acceptance", rising).success
    loaded = len(_get_engine().definitions)
    validate("acceptance", rising, suites_dir=tmp_path)
    assert len(_get_engine().definitions) == loaded  # suites are loaded once per file version


def test_every_artifact_kind_has_its_suite_and_row_model_and_every_suite_a_kind():
    """One registry (tasks/record/kinds.py): a kind without a suite, or a suite no kind names, is a mistake."""
    suites = {p.stem for p in SUITES_DIR.glob("*.json")}
    assert suites == set(KINDS)
    for k in KINDS.values():
        fields = k.model().model_fields
        assert set(k.keys) <= set(fields), (k.name, set(k.keys) - set(fields))
