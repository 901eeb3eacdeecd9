"""The artifact kinds: one registry that expectations, history, the report and the UI iterate.

Each kind names its row model ("module:Class", imported on use: this module stays at the bottom
of the import graph), its suite (`expectations/<name>.json`), the columns naming a row in a
failure line, and whether history indexes it and Prefect publishes it. `METRICS` names the
columns the regression check judges. A new kind is one entry here plus its suite.
"""

from __future__ import annotations

from dataclasses import dataclass
from importlib import import_module
from typing import Literal

from pydantic import BaseModel


@dataclass(frozen=True)
class ArtifactKind:
    name: str
    row_model: str  # "module:Class"; "" for a raw table with no row model (requests.jsonl)
    keys: tuple[str, ...]  # columns naming a row in a failure line
    history: bool = False  # indexed by `lanebench history` (DuckDB over every run folder)
    published: bool = False  # a Prefect table artifact in the UI

    def model(self) -> type[BaseModel]:
        module, cls = self.row_model.split(":")
        return getattr(import_module(module), cls)


KINDS: dict[str, ArtifactKind] = {k.name: k for k in (
    ArtifactKind("requests", "tasks.wire.records:RequestRecord", ("lane", "stage", "repeat", "concurrency", "prompt_id")),
    ArtifactKind("warmup", "tasks.record.rows:WarmupRow", ("lane", "concurrency", "size_class")),
    ArtifactKind("decode", "tasks.record.rows:DecodeRow", ("lane", "concurrency"), history=True, published=True),
    ArtifactKind("acceptance", "tasks.record.rows:AcceptanceRow", ("lane", "prompt_class", "k"), history=True, published=True),
    ArtifactKind("kl_positions", "tasks.wire.kl_probes:KlPositionRow", ("lane", "prompt_id", "position")),
    ArtifactKind("kl_summary", "tasks.wire.kl_probes:KlSummaryRow", ("lane",), history=True),
    ArtifactKind("kl_pairs", "tasks.wire.kl_probes:KlPairRow", ("lane_a", "lane_b")),
    ArtifactKind("regression", "tasks.record.table_rows:RegressionRow", ("lane", "metric"), history=True, published=True),
    ArtifactKind("matrix_arms", "tasks.record.table_rows:ArmClassRow", ("arm", "prompt_class")),
    ArtifactKind("matrix_verdict", "tasks.record.table_rows:VerdictRow", ("bar_index", "arm")),
    ArtifactKind("tools", "tasks.record.table_rows:ToolGateRow", ("lane", "suite")),
    ArtifactKind("needles", "tasks.record.table_rows:NeedleRow", ("lane",)),
    ArtifactKind("prefill", "tasks.record.table_rows:PrefillRow", ("lane", "rung", "status"), history=True, published=True),
    ArtifactKind("accuracy", "tasks.record.table_rows:AccuracyRow", ("lane", "measure"), history=True, published=True),
    ArtifactKind("capacity", "tasks.record.table_rows:CapacityRow", ("lane", "users"), published=True),
    ArtifactKind("queueing", "tasks.record.table_rows:QueueRow", ("lane", "concurrency"), published=True),
)}


def kind(name: str) -> ArtifactKind:
    if name not in KINDS:
        raise ValueError(f"unknown artifact kind {name!r}; expected one of {', '.join(KINDS)}")
    return KINDS[name]


def history_kinds() -> list[ArtifactKind]:
    return [k for k in KINDS.values() if k.history]


def published_kinds() -> list[str]:
    return [k.name for k in KINDS.values() if k.published]


@dataclass(frozen=True)
class MetricDef:
    """How one column of one result table becomes a named metric (`prefix@c<concurrency>`, `prefix@<class>`)."""

    table: str
    column: str
    prefix: str
    key: Literal["concurrency", "prompt_class", "rung", ""]
    family: Literal["throughput", "latency", "acceptance", "kl", "accuracy"]
    better: Literal["higher", "lower"]
    headline: bool  # compared night to night (the others are for history queries)
    lo: str = "NULL"
    hi: str = "NULL"
    where: str = "TRUE"  # rows that count (queueing levels never feed a speed verdict)
    # The p95 of four requests is their maximum: rows with fewer than `min_samples` (SQL `samples`)
    # are kept for history, never judged nor a baseline.
    samples: str = "NULL"
    min_samples: int = 0

    @property
    def name_sql(self) -> str:
        mark = {"concurrency": "c", "prompt_class": "", "rung": "r"}
        return f"'{self.prefix}@{mark[self.key]}' || t.{self.key}" if self.key else f"'{self.prefix}'"


_MEASURED = "COALESCE(t.regime, 'measured') = 'measured'"  # decode levels past the cap are a queue, not a speed

METRICS: tuple[MetricDef, ...] = (
    MetricDef("decode", "aggregate_tok_s", "tok_s", "concurrency", "throughput", "higher", True,
              "t.aggregate_tok_s_min", "t.aggregate_tok_s_max", where=_MEASURED),
    MetricDef("decode", "ttft_p95_s", "ttft_p95_s", "concurrency", "latency", "lower", True, where=_MEASURED,
              samples="t.requests - t.failed_requests", min_samples=20),
    MetricDef("decode", "per_user_tok_s", "per_user_tok_s", "concurrency", "throughput", "higher", False,
              where=_MEASURED),
    MetricDef("decode", "ttft_p50_s", "ttft_p50_s", "concurrency", "latency", "lower", False, where=_MEASURED),
    MetricDef("decode", "itl_p50_s", "itl_p50_s", "concurrency", "latency", "lower", False, where=_MEASURED),
    MetricDef("acceptance", "acceptance_length", "acceptance_length", "prompt_class", "acceptance", "higher", True,
              "t.acceptance_length_min", "t.acceptance_length_max"),
    MetricDef("kl_summary", "mean_abs_dlogprob", "kl_mean_abs_dlogprob", "", "kl", "lower", True),
    MetricDef("kl_summary", "p95_abs_dlogprob", "kl_p95_abs_dlogprob", "", "kl", "lower", True),
    MetricDef("kl_summary", "argmax_flip_share", "kl_argmax_flip_share", "", "kl", "lower", True),
    # Prefill ladder, for history only: one cold hit per rung has no spread, and a short rung's speed
    # is mostly request overhead (on the 2-core rehearsal box, r32 moved 36 % between idle nights).
    MetricDef("prefill", "prefill_tok_s", "prefill_tok_s", "rung", "throughput", "higher", False,
              where="t.status = 'measured'"),
    MetricDef("prefill", "cold_ttft_s", "prefill_ttft_s", "rung", "latency", "lower", False,
              where="t.status = 'measured'"),
    MetricDef("prefill", "warm_ttft_s", "prefill_warm_ttft_s", "rung", "latency", "lower", False,
              where="t.status = 'measured'"),
    # Accuracy: the floor and the share cut off are judged; the raw score never stands alone.
    MetricDef("accuracy", "value", "accuracy_floor", "", "accuracy", "higher", True, "t.ci_low", "t.ci_high",
              where="t.measure = 'floor'"),
    MetricDef("accuracy", "value", "accuracy_truncated_share", "", "accuracy", "lower", True, "t.ci_low",
              "t.ci_high", where="t.measure = 'truncated_share'"),
    MetricDef("accuracy", "value", "accuracy_raw", "", "accuracy", "higher", False, "t.ci_low", "t.ci_high",
              where="t.measure = 'raw'"),
    MetricDef("accuracy", "value", "accuracy_finished_right", "", "accuracy", "higher", False, "t.ci_low",
              "t.ci_high", where="t.measure = 'finished_right'"),
)

# Columns a later version added to a table kind: older Parquet files lack them, the index adds them.
ADDED_COLUMNS: dict[str, dict[str, str]] = {"decode": {"regime": "VARCHAR"}}


def metric_def(metric: str) -> MetricDef | None:
    """The definition behind a metric name (`tok_s@c4` -> the decode aggregate)."""
    prefix = metric.split("@", 1)[0]
    return next((d for d in METRICS if d.prefix == prefix), None)
