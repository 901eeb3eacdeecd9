"""Failure notification: a Prefect on-failure hook that sends through a Prefect notification block.

A hook rather than an automation: it needs nothing configured on the server (ephemeral, `serve` or
shared) and can read the run folder for the regression list. Where it goes (environment, or the
deployment's `job_variables.env`, so no secret sits in prefect.yaml): `LANEBENCH_NOTIFY_BLOCK`, a
saved notification block `<block-type>/<name>` (Slack, Teams, PagerDuty, ...), gets the `text` as
body; `LANEBENCH_NOTIFY_URL`, a JSON webhook, gets the whole payload (Slack reads its `text`).
The payload comes from the run folder; a notification that fails is logged, never raised.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, cast

from pydantic import BaseModel

from tasks.hosts.retry import retrying

URL_ENV = "LANEBENCH_NOTIFY_URL"
BLOCK_ENV = "LANEBENCH_NOTIFY_BLOCK"


class Regression(BaseModel):
    lane: str
    metric: str
    better: str
    current: float
    baseline: float
    change_pct: float
    ci_low_pct: float
    ci_high_pct: float
    baseline_runs: int


class Notice(BaseModel):
    """The webhook's JSON body; `text` is what a chat block shows."""

    source: str = "lanebench"
    flow: str
    flow_run_id: str
    flow_run_name: str
    state: str
    message: str
    run_folder: str | None
    failed_lanes: dict[str, str] = {}
    regressions: list[Regression] = []
    text: str


def payload(flow_name: str, flow_run_id: str, flow_run_name: str, state_name: str, message: str,
            folder: Path | None) -> Notice:
    """What failed and why: failed lanes with reasons, regressions with size and interval."""
    import pandas as pd

    failed_lanes: dict[str, str] = {}
    regressions: list[Regression] = []
    if folder is not None and (folder / "manifest.json").is_file():
        from tasks.record.manifest import read_manifest

        manifest = read_manifest(folder)
        failed_lanes = {n: lane.reason for n, lane in manifest.lanes.items() if lane.status == "failed"}
        for a in manifest.artifacts:
            if a.kind == "regression" and a.validation == "passed":
                df = pd.read_parquet(folder / a.path)
                regressions += [Regression.model_validate(r) for r in df[df.verdict == "regression"].to_dict(orient="records")]
    lines = [f"lanebench {flow_name} {flow_run_name}: {state_name}: {message}"]
    lines += [f"- regression {r.lane} {r.metric} {r.change_pct:+.1f}% [{r.ci_low_pct:+.1f}%, {r.ci_high_pct:+.1f}%]"
              for r in regressions]
    return Notice(flow=flow_name, flow_run_id=flow_run_id, flow_run_name=flow_run_name, state=state_name,
                  message=message, run_folder=str(folder) if folder else None, failed_lanes=failed_lanes,
                  regressions=regressions, text="\n".join(lines))


def send(body: Notice) -> None:
    """Deliver through the configured notification block; raises when delivery fails."""
    from prefect.blocks.core import Block
    from prefect.blocks.notifications import CustomWebhookNotificationBlock

    subject = f"lanebench {body.flow}: {body.state}"
    if name := os.environ.get(BLOCK_ENV):
        cast(Any, Block.load(name)).notify(body=body.text, subject=subject)  # a notification block, loaded sync
    if url := os.environ.get(URL_ENV):
        CustomWebhookNotificationBlock(name="lanebench", url=url, json_data=body.model_dump(mode="json"),
                                       timeout=10).notify(body=body.text, subject=subject)


def on_failure(flow: Any, flow_run: Any, state: Any) -> None:
    """Prefect hook (`@flow(on_failure=[on_failure], on_crashed=[on_failure])`)."""
    from prefect.logging import get_logger

    if not (os.environ.get(URL_ENV) or os.environ.get(BLOCK_ENV)):
        return
    logger = get_logger("lanebench.notify")
    try:
        from tasks.record.progress import written_by
        from tasks.record.store import Store

        root = (flow_run.parameters or {}).get("artifacts_root")  # a store's run folder was written in its local mirror
        folder = written_by(Store(root).local_root, flow.name, str(flow_run.id)) if root else None
        body = payload(flow.name, str(flow_run.id), flow_run.name, state.name, state.message or "", folder)
    except Exception:  # a broken notifier must never change the run's outcome
        logger.exception("failure notification could not be built")
        return
    try:  # one retry: a receiver restarting is common, a long outage is not ours to wait out
        retrying(tries=2, wait_s=2.0, on=Exception)(send, body)
    except Exception as e:
        logger.error("could not deliver the failure notification: %s: %s", type(e).__name__, e)
