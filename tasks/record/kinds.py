"""The headline metrics of the artifact kinds: what history indexes and the regression check judges."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal


@dataclass(frozen=True)
class MetricDef:
    """How one column of one result table becomes a named metric (`prefix@c<concurrency>`, `prefix@<class>`)."""

    table: str
    column: str
    prefix: str
    key: Literal["concurrency", "prompt_class", ""]
    family: Literal["throughput", "latency", "acceptance", "kl"]
    better: Literal["higher", "lower"]
    headline: bool  # compared night to night (the others are for history queries)
    lo: str = "NULL"
    hi: str = "NULL"

    @property
    def name_sql(self) -> str:
        if self.key == "concurrency":
            return f"'{self.prefix}@c' || t.concurrency"
        if self.key == "prompt_class":
            return f"'{self.prefix}@' || t.prompt_class"
        return f"'{self.prefix}'"


METRICS: tuple[MetricDef, ...] = (
    MetricDef("decode", "aggregate_tok_s", "tok_s", "concurrency", "throughput", "higher", True,
              "t.aggregate_tok_s_min", "t.aggregate_tok_s_max"),
    MetricDef("decode", "ttft_p95_s", "ttft_p95_s", "concurrency", "latency", "lower", True),
    MetricDef("decode", "per_user_tok_s", "per_user_tok_s", "concurrency", "throughput", "higher", False),
    MetricDef("decode", "ttft_p50_s", "ttft_p50_s", "concurrency", "latency", "lower", False),
    MetricDef("decode", "itl_p50_s", "itl_p50_s", "concurrency", "latency", "lower", False),
    MetricDef("acceptance", "acceptance_length", "acceptance_length", "prompt_class", "acceptance", "higher", True,
              "t.acceptance_length_min", "t.acceptance_length_max"),
    MetricDef("kl_summary", "mean_abs_dlogprob", "kl_mean_abs_dlogprob", "", "kl", "lower", True),
    MetricDef("kl_summary", "p95_abs_dlogprob", "kl_p95_abs_dlogprob", "", "kl", "lower", True),
    MetricDef("kl_summary", "argmax_flip_share", "kl_argmax_flip_share", "", "kl", "lower", True),
)


def metric_def(metric: str) -> MetricDef | None:
    """The definition behind a metric name (`tok_s@c4` -> the decode aggregate)."""
    prefix = metric.split("@", 1)[0]
    return next((d for d in METRICS if d.prefix == prefix), None)
