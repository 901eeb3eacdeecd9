"""Great Expectations gate: every result artifact is validated before it counts.

One GX suite per kind in `expectations/<kind>.json` (each expectation's `meta.why` names the
mistake it catches). Pandas datasources cannot run row-level SQL (`UnexpectedRowsExpectation`), so
invariants GX cannot state are computed first by `derive` and checked as plain columns. GX takes
seconds to import: it is imported lazily, and one ephemeral context serves the whole process.
"""

from __future__ import annotations

import json
import logging
import math
import re
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
from pydantic import BaseModel

from tasks.inventory.paths import REPO
from tasks.record.kinds import kind as artifact_kind

SUITES_DIR = REPO / "expectations"
# Derived column -> the source columns shown beside it when it fails.
_DERIVED_FROM: dict[str, list[str]] = {
    "k_plus_1": ["k"], "rung_fill": ["rung", "prompt_tokens"],
    **dict.fromkeys(("per_position_len", "per_position_min", "per_position_max", "per_position_nonincreasing"),
                    ["per_position"]),
}
_MONOTONE_TOL = 1e-9  # rates are ratios of counters (or means of them): allow float noise only
_ROWS_SHOWN = 3
_RESULT_FORMAT = {"result_format": "SUMMARY", "partial_unexpected_count": 20}


class Validation(BaseModel):
    """The verdict on one artifact, plus GX's own result JSON to save beside it."""

    kind: str
    success: bool
    evaluated: int  # expectations evaluated
    failed: list[str]  # one readable line per failed expectation
    result: dict


def _curve(value: Any) -> list[float] | None:
    """A per-position list from a list, tuple, array or JSON string; None if it is not one."""
    try:
        value = json.loads(value) if isinstance(value, str) else value
        rates = [float(v) for v in value] if isinstance(value, list | tuple | np.ndarray) else None
    except (TypeError, ValueError):
        return None
    return None if rates is None or any(math.isnan(r) for r in rates) else rates


def derive(kind: str, df: pd.DataFrame) -> pd.DataFrame:
    """A new frame with the columns a suite checks but GX cannot compute on pandas (missing sources
    skipped: the column-set expectation names them; index reset for the failure lines).

    acceptance: `k_plus_1` (k drafts plus the bonus token bound acceptance_length),
    `per_position_len` (= k), `per_position_min`/`_max` (in [0, 1]), `per_position_nonincreasing`
    (False when no list); prefill: `rung_fill` (prompt tokens counted / the rung's size).
    """
    out = df.reset_index(drop=True)
    if kind == "acceptance":
        if "k" in out.columns:
            out["k_plus_1"] = pd.to_numeric(out["k"], errors="coerce") + 1
        if "per_position" in out.columns:
            curves = [_curve(v) for v in out["per_position"]]
            nan = float("nan")
            out["per_position_len"] = pd.Series([nan if c is None else len(c) for c in curves], dtype="float64")
            out["per_position_min"] = pd.Series([min(c) if c else nan for c in curves], dtype="float64")
            out["per_position_max"] = pd.Series([max(c) if c else nan for c in curves], dtype="float64")
            out["per_position_nonincreasing"] = pd.Series(
                [c is not None and all(b <= a + _MONOTONE_TOL for a, b in zip(c, c[1:])) for c in curves], dtype="bool")
    if kind == "prefill" and {"rung", "prompt_tokens"} <= set(out.columns):
        out["rung_fill"] = pd.to_numeric(out["prompt_tokens"], errors="coerce") / pd.to_numeric(out["rung"], errors="coerce")
    return out


class _Engine:
    """One ephemeral GX context per process, with one validation definition per loaded suite."""

    def __init__(self) -> None:
        import great_expectations as gx
        from great_expectations.data_context.types.base import ProgressBarsConfig

        # GX sets levels on its own loggers at import; its INFO lines are not ours to show.
        for name in [n for n in logging.root.manager.loggerDict if n.startswith("great_expectations")]:
            logging.getLogger(name).setLevel(logging.WARNING)

        self.gx = gx
        self.context = gx.get_context(mode="ephemeral")
        self.context.variables.progress_bars = ProgressBarsConfig(globally=False)
        self.source = self.context.data_sources.add_pandas("lanebench")
        self.definitions: dict[tuple[str, int], Any] = {}
        self.lock = threading.Lock()  # a context is not meant for concurrent use

    def definition(self, path: Path) -> Any:
        """The ValidationDefinition for a suite file, loaded once per (path, mtime)."""
        key = (str(path.resolve()), path.stat().st_mtime_ns)
        if key not in self.definitions:
            suite = self.gx.ExpectationSuite(**json.loads(path.read_text()))
            name = f"{suite.name}-{len(self.definitions)}"  # unique: a suite may be reloaded
            suite.name = name
            suite = self.context.suites.add(suite)
            batch = self.source.add_dataframe_asset(name).add_batch_definition_whole_dataframe("whole")
            self.definitions[key] = self.context.validation_definitions.add(
                self.gx.ValidationDefinition(name=name, data=batch, suite=suite))
        return self.definitions[key]


_engine: _Engine | None = None
_engine_lock = threading.Lock()


def _get_engine() -> _Engine:
    global _engine
    with _engine_lock:
        if _engine is None:
            _engine = _Engine()
        return _engine


def warm_up(kinds: list[str], and_then: Callable[[], object]) -> None:
    """Import GX and load the suites in a background thread while the server boots: GX's first check
    costs seconds, a stall with no request in flight when paid in the warmup window. `and_then`
    runs next (the plotting library: a second of the run's tail when imported after the last
    request); measuring waits for both (`warmed_up`)."""
    global _warming
    if _warming is not None:  # started already (the CLI starts it while Prefect's API server boots)
        return

    def load() -> None:
        engine = _get_engine()
        for path in (SUITES_DIR / f"{name}.json" for name in kinds):
            if path.is_file():
                with engine.lock:
                    engine.definition(path)
        and_then()

    _warming = threading.Thread(target=load, name="gx-warm-up", daemon=True)
    _warming.start()


_warming: threading.Thread | None = None


def warmed_up(timeout_s: float = 120.0) -> None:
    """Wait for `warm_up` before the first measured request: an import beside the client took the GIL
    (the warmup's steady TTFT read 32 ms against a first hit of 14 ms, flagged as host noise)."""
    if _warming is not None:
        _warming.join(timeout_s)


def validate(kind: str, df: pd.DataFrame, suites_dir: Path = SUITES_DIR) -> Validation:
    """Validate one artifact frame against `suites_dir/<kind>.json`."""
    keys = list(artifact_kind(kind).keys)  # an unknown kind is a programming error: it raises
    frame = derive(kind, df)
    engine = _get_engine()
    with engine.lock:
        definition = engine.definition(Path(suites_dir) / f"{kind}.json")
        run = definition.run(batch_parameters={"dataframe": frame}, result_format=_RESULT_FORMAT)
    result = run.to_json_dict()
    failed = [_failure_line(r, frame, keys) for r in result["results"] if not r["success"]]
    return Validation(kind=kind, success=bool(result["success"]), failed=failed, result=result,
                      evaluated=int(result["statistics"]["evaluated_expectations"]))


def _condition_text(condition: Any) -> str:
    """A row_condition as text (GX's own repr of its Condition objects), '' when there is none."""
    if not condition:
        return ""
    from great_expectations.expectations.row_conditions import deserialize_row_condition

    parsed = deserialize_row_condition(condition)
    return parsed if isinstance(parsed, str) else repr(parsed)


def _short(value: Any, width: int = 60) -> str:
    text = repr(value.tolist() if isinstance(value, np.ndarray | np.generic) else value)
    return text if len(text) <= width else text[: width - 3] + "..."


def _failure_line(res: dict, frame: pd.DataFrame, keys: list[str]) -> str:
    """`type(columns): what was wrong`, with up to a few offending rows shown by key and value."""
    config = res["expectation_config"]
    kwargs = config["kwargs"]
    columns = [kwargs[c] for c in ("column", "column_A", "column_B") if c in kwargs] + list(kwargs.get("column_list", []))
    head = f"{config['type']}({', '.join(columns)})"
    exc = res.get("exception_info") or {}
    errors = [exc] if "raised_exception" in exc else list(exc.values())
    messages = [e.get("exception_message") for e in errors if isinstance(e, dict) and e.get("raised_exception")]
    if messages:
        return f"{head}: could not evaluate: {messages[0]}"
    result = res.get("result") or {}
    if "unexpected_count" in result:
        condition_text = _condition_text(kwargs.get("row_condition"))
        shown = [*keys, *columns]
        shown += [s for c in columns for s in _DERIVED_FROM.get(c, [])]
        shown += [c for c in frame.columns if condition_text and re.search(rf"\b{re.escape(str(c))}\b", condition_text)]
        shown = [c for c in dict.fromkeys(shown) if c in frame.columns]
        rows = [
            "{" + ", ".join(f"{c}={_short(frame.at[i, c])}" for c in shown) + "}"
            for i in result.get("partial_unexpected_index_list", [])[:_ROWS_SHOWN]
            if isinstance(i, int) and i in frame.index
        ] or [_short(v) for v in result.get("partial_unexpected_list", [])[:_ROWS_SHOWN]]
        where = f" where {condition_text}" if condition_text else ""
        return f"{head}: {result['unexpected_count']}/{result.get('element_count')} rows unexpected{where}, e.g. {'; '.join(rows)}"
    missing = (result.get("details") or {}).get("mismatched", {}).get("missing")
    if missing:
        return f"{head}: missing columns {missing}"
    bounds = {k: v for k, v in kwargs.items() if k in ("min_value", "max_value", "value")}
    return f"{head}: observed {_short(result.get('observed_value'))}, expected {bounds}"
