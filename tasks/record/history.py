"""Run history: one DuckDB index over every run folder under an artifacts root.

The folders stay the source of truth: the index is rebuilt from their manifests and the validated
Parquet tables they list (a quarantined table never counts) each time it is opened, or on demand
into `artifacts/.history.duckdb`. Nothing is written back into a run folder. Tables: `runs`,
`lanes` (status and identity: image digest, model/drafter sha256, engine binary), `artifacts`, one
per history kind, and the long view `metrics` (run, lane, metric, value, [lo, hi], passed,
regressed, identity) that queries, trends and the regression check read; metric names like
`tok_s@c4`, `acceptance_length@code`, `kl_mean_abs_dlogprob`.
"""

from __future__ import annotations

import hashlib
import json
import types
import typing
from pathlib import Path
from typing import Any

import pandas as pd
from pydantic import JsonValue

from tasks.hosts.files import file_sha256
from tasks.record.manifest import Manifest, Outside, confined, scan_manifests
from tasks.record.kinds import ADDED_COLUMNS, KINDS, METRICS, MetricDef, history_kinds, metric_def  # noqa: F401  (re-exported for queries)

INDEX_FILE = ".history.duckdb"


def _sql_type(annotation: Any) -> str:
    """DuckDB type of a pydantic field, for the empty table of a kind no run has yet."""
    origin = typing.get_origin(annotation)
    if origin in (typing.Union, types.UnionType):
        inner = [a for a in typing.get_args(annotation) if a is not type(None)]
        return _sql_type(inner[0])
    if origin is list:
        return _sql_type(typing.get_args(annotation)[0]) + "[]"
    return {int: "BIGINT", float: "DOUBLE", bool: "BOOLEAN"}.get(annotation, "VARCHAR")


def _lane_rows(run: str, manifest: Manifest) -> list[dict[str, JsonValue]]:
    rows = []
    for name, lane in manifest.lanes.items():
        models = {m.role: m for m in lane.models}
        model, drafter = models.get("model"), models.get("drafter")
        identity, config_json = lane.engine_identity, json.dumps(lane.config, sort_keys=True)
        rows.append({
            "run": run, "lane": name, "status": lane.status, "reason": lane.reason, "stage": lane.stage,
            "host": lane.config.get("host"), "engine": lane.config.get("engine"),
            "image": lane.config.get("image") or identity.get("image"),
            "model_path": model.path if model else None, "model_sha256": model.sha256 if model else None,
            "drafter_path": drafter.path if drafter else None, "drafter_sha256": drafter.sha256 if drafter else None,
            "engine_source": identity.get("source"),
            "engine_sha256": identity.get("sha256") or next(
                (v for k, v in identity.items() if k.endswith("sha256") and k != "source"), None),
            "launch_command": lane.launch_command, "config": config_json,
            "config_sha256": hashlib.sha256(config_json.encode()).hexdigest(),
        })
    return rows


def scan(root: Path) -> tuple[pd.DataFrame, pd.DataFrame, pd.DataFrame]:
    """runs, lanes and artifacts of every run folder under `root` (folders without a readable manifest are left out)."""
    runs, lanes, artifacts = [], [], []
    for folder, m in scan_manifests(root):
        flow = m.flow
        runs.append({
            "run": folder.name, "path": str(folder.resolve()), "flow": flow.name, "flow_run_id": flow.flow_run_id,
            "started_at": flow.started_at, "finished_at": flow.finished_at, "git_sha": m.lanebench.git_sha,
            "dirty": m.lanebench.dirty, "inventory_sha256": m.inventory.sha256 if m.inventory else None,
            "hostname": m.host.hostname, "status": flow.status, "interrupted_by": flow.interrupted_by,
        })
        lanes += _lane_rows(folder.name, m)
        for a in m.artifacts:
            try:
                path, outside = str(confined(folder, a.path).resolve()), None
            except Outside as e:
                path, outside = "", str(e)
            artifacts.append({"run": folder.name, "lane": a.lane, "kind": a.kind, "path": path, "rel": a.path,
                              "sha256": a.sha256, "rows": a.rows, "validation": a.validation, "outside": outside})
    runs_df = pd.DataFrame(runs, columns=["run", "path", "flow", "flow_run_id", "started_at", "finished_at", "git_sha",
                                          "dirty", "inventory_sha256", "hostname", "status", "interrupted_by"])
    for col in ("started_at", "finished_at"):
        runs_df[col] = pd.to_datetime(runs_df[col], utc=True, format="ISO8601")
    lane_cols = ["run", "lane", "status", "reason", "stage", "host", "engine", "image", "model_path", "model_sha256",
                 "drafter_path", "drafter_sha256", "engine_source", "engine_sha256", "launch_command", "config",
                 "config_sha256"]
    art_cols = ["run", "lane", "kind", "path", "rel", "sha256", "rows", "validation", "outside"]
    return runs_df, pd.DataFrame(lanes, columns=lane_cols), pd.DataFrame(artifacts, columns=art_cols)


def _load_table(con: Any, kind: str, files: list[str]) -> None:
    if files:
        con.execute(f"""CREATE TABLE {kind} AS
            SELECT a.run, t.* EXCLUDE (filename)
            FROM read_parquet(?, filename = true, union_by_name = true) t JOIN artifacts a ON a.path = t.filename""",
                    [files])
        return
    fields = KINDS[kind].model().model_fields
    cols = ", ".join(f'"{n}" {_sql_type(f.annotation)}' for n, f in fields.items())
    con.execute(f"CREATE TABLE {kind} (run VARCHAR, {cols})")


def _metrics_view(con: Any) -> None:
    selects = []
    for d in METRICS:
        passed = "COALESCE(l.status = 'passed', FALSE)" if d.table != "kl_summary" else "t.status = 'complete'"
        # An unstable row (host noise, tasks/hosts/noise.py) is no baseline; older tables lack the column.
        if "unstable" in con.execute(f"SELECT * FROM {d.table} LIMIT 0").df().columns:
            passed += " AND NOT COALESCE(t.unstable, FALSE)"
        selects.append(f"""
            SELECT t.run, t.lane, {d.name_sql} AS metric, '{d.family}' AS family, '{d.better}' AS better,
                   {str(d.headline).upper()} AS headline, CAST(t.{d.column} AS DOUBLE) AS value,
                   CAST({d.lo} AS DOUBLE) AS lo, CAST({d.hi} AS DOUBLE) AS hi, {passed} AS passed,
                   CAST({d.samples} AS BIGINT) AS samples
            FROM {d.table} t LEFT JOIN lanes l ON l.run = t.run AND l.lane = t.lane WHERE {d.where}""")
    con.execute(f"""CREATE VIEW metrics AS
        WITH m AS ({' UNION ALL '.join(selects)}),
             regressed AS (SELECT DISTINCT run, lane FROM regression WHERE verdict = 'regression'),
             suspect AS (SELECT DISTINCT run, lane FROM regression WHERE verdict = 'suspect')
        SELECT r.started_at, r.flow, m.*, (g.run IS NOT NULL) AS regressed, (s.run IS NOT NULL) AS suspect,
               r.git_sha, r.dirty, l.image, l.model_sha256, l.drafter_sha256, l.engine_source, l.engine_sha256,
               l.config_sha256, r.path AS run_path
        FROM m JOIN runs r ON r.run = m.run
             LEFT JOIN lanes l ON l.run = m.run AND l.lane = m.lane
             LEFT JOIN regressed g ON g.run = m.run AND g.lane = m.lane
             LEFT JOIN suspect s ON s.run = m.run AND s.lane = m.lane""")


def refuse_tampered(artifacts: pd.DataFrame) -> tuple[pd.DataFrame, pd.DataFrame]:
    """(kept artifacts, refused ones with run, path and reason): a table whose bytes no longer match
    its manifest's sha256 is never served."""
    refused, keep, indexed = [], [], {k.name for k in history_kinds()}
    for i, a in artifacts.iterrows():
        if isinstance(a.outside, str) and a.outside:  # never opened
            refused.append({"run": a.run, "path": a.rel, "reason": a.outside})
            continue
        if a.kind in indexed and a.validation == "passed":
            try:
                ok = file_sha256(a.path) == a.sha256
                why = "its sha256 differs from the manifest (changed after the run)"
            except OSError as e:
                ok, why = False, f"cannot be read ({e.strerror})"
            if not ok:
                refused.append({"run": a.run, "path": a.rel, "reason": why})
                continue
        keep.append(i)
    return artifacts.loc[keep], pd.DataFrame(refused, columns=["run", "path", "reason"])


def open_index(root: str | Path, database: str = ":memory:") -> Any:
    """A DuckDB connection holding the index of every run folder under `root`, freshly built."""
    import duckdb

    runs, lanes, artifacts = scan(Path(root))
    artifacts, refused = refuse_tampered(artifacts)
    con = duckdb.connect(database)
    for name, df in (("runs", runs), ("lanes", lanes), ("artifacts", artifacts), ("refused", refused)):
        con.register(f"_{name}", df)
        con.execute(f"CREATE OR REPLACE TABLE {name} AS SELECT * FROM _{name}")
        con.unregister(f"_{name}")
    for kind in (k.name for k in history_kinds()):
        files = artifacts[(artifacts.kind == kind) & (artifacts.validation == "passed")].path.tolist()
        con.execute(f"DROP TABLE IF EXISTS {kind}")
        _load_table(con, kind, files)
        for column, sql_type in ADDED_COLUMNS.get(kind, {}).items():
            con.execute(f"ALTER TABLE {kind} ADD COLUMN IF NOT EXISTS {column} {sql_type}")
    con.execute("DROP VIEW IF EXISTS metrics")
    _metrics_view(con)
    return con


def reindex(root: str | Path) -> Path:
    """Rebuild `root/.history.duckdb` from the folders (the old file is simply replaced)."""
    target = Path(root) / INDEX_FILE
    tmp = target.with_suffix(".tmp")
    tmp.unlink(missing_ok=True)
    open_index(root, str(tmp)).close()
    tmp.replace(target)
    return target


# --- the questions `lanebench history` answers -------------------------------------------------

_PROVENANCE = ["git_sha", "dirty", "image", "model_sha256", "drafter_sha256", "engine_source", "engine_sha256"]


def metric_history(con: Any, lane: str, metric: str, last: int = 20, flow: str | None = None) -> pd.DataFrame:
    """A metric of a lane over its last `last` runs, oldest first, with what produced each number."""
    cols = ", ".join(["run", "started_at", "flow", "value", "lo", "hi", "passed", "regressed", "suspect", *_PROVENANCE])
    df = con.execute(f"""SELECT {cols} FROM (
            SELECT * FROM metrics WHERE lane = ? AND metric = ? AND (? IS NULL OR flow = ?)
            ORDER BY started_at DESC LIMIT ?) ORDER BY started_at""", [lane, metric, flow, flow, last]).df()
    paths = dict(con.execute("SELECT run, path FROM runs").fetchall())
    df["check"] = [_check(paths.get(run), value, df.loc[df.run != run, "value"])
                   for run, value in zip(df.run, df.value)]
    return df


def _check(path: str | None, value: float, others: pd.Series) -> str:
    """A value's manifest against the signed ledger, then the value against the lane's recorded range
    (issue 27: a forged 1154 tok/s was served beside 533-814 without remark)."""
    from tasks.record import ledger

    state, _ = ledger.check(Path(path)) if path else ("absent", "")
    why = "not in the signed ledger" if state == "absent" else "rewritten after its run"
    notes = [] if state == "verified" else [f"unverified ({why})"]
    others = others.dropna()
    if len(others) >= 2 and not (others.min() <= value <= others.max()):
        notes.append(f"outlier: outside the lane's recorded range {others.min():.4g}-{others.max():.4g}")
    return "; ".join(notes) or "ok"


def list_runs(con: Any, flow: str | None = None, last: int = 20) -> pd.DataFrame:
    return con.execute("""SELECT * FROM (
            SELECT r.run, r.flow, r.started_at, r.finished_at,
                   CASE WHEN r.status = 'interrupted' THEN 'interrupted (' || COALESCE(r.interrupted_by, '?') || ')'
                        ELSE r.status END AS status,
                   r.git_sha, r.dirty,
                   count(l.lane) AS lanes, count(l.lane) FILTER (WHERE l.status = 'passed') AS passed,
                   count(l.lane) FILTER (WHERE l.status = 'failed') AS failed,
                   count(l.lane) FILTER (WHERE l.status = 'skipped') AS skipped,
                   count(l.lane) FILTER (WHERE l.status = 'interrupted') AS interrupted,
                   (SELECT count(*) FROM regression g WHERE g.run = r.run AND g.verdict = 'regression') AS regressions
            FROM runs r LEFT JOIN lanes l ON l.run = r.run
            WHERE ? IS NULL OR r.flow = ?
            GROUP BY ALL ORDER BY r.started_at DESC LIMIT ?) ORDER BY started_at""", [flow, flow, last]).df()


def resolve_run(con: Any, run: str | None, flow: str | None = None) -> str | None:
    """A run folder from its name, a unique prefix or suffix (e.g. the short flow-run id), or the latest of `flow`."""
    if run is None:
        row = con.execute("SELECT run FROM runs WHERE ? IS NULL OR flow = ? ORDER BY started_at DESC LIMIT 1",
                          [flow, flow]).fetchone()
        return row[0] if row else None
    name = Path(run).name
    rows = con.execute("SELECT run FROM runs WHERE run = ? OR run LIKE ? || '%' OR run LIKE '%' || ?",
                       [name, name, name]).fetchall()
    return rows[0][0] if len(rows) == 1 else None


def matrix_runs(con: Any, run: str) -> pd.DataFrame:
    """The arms (lanes) of one matrix run, their status, identity and headline numbers side by side."""
    arms = con.execute("""SELECT lane AS arm, status, reason, model_sha256, drafter_sha256, image, engine_sha256
                          FROM lanes WHERE run = ? ORDER BY lane""", [run]).df()
    values = con.execute("SELECT lane AS arm, metric, value FROM metrics WHERE run = ? AND headline", [run]).df()
    if values.empty:
        return arms
    wide = values.pivot_table(index="arm", columns="metric", values="value", aggfunc="first").reset_index()
    wide.columns.name = None
    return arms.merge(wide, on="arm", how="left")


def provenance(con: Any, run: str, lane: str | None = None) -> pd.DataFrame:
    """What produced a run's numbers: lanebench SHA, image digest, model and drafter sha256, engine binary."""
    return con.execute("""SELECT l.run, l.lane, l.status, r.git_sha, r.dirty, l.image, l.model_path, l.model_sha256,
                                 l.drafter_path, l.drafter_sha256, l.engine_source, l.engine_sha256, r.inventory_sha256,
                                 l.launch_command
                          FROM lanes l JOIN runs r USING (run)
                          WHERE l.run = ? AND (? IS NULL OR l.lane = ?) ORDER BY l.lane""", [run, lane, lane]).df()


def available_metrics(con: Any, lane: str | None = None) -> pd.DataFrame:
    return con.execute("""SELECT lane, metric, family, better, headline, count(*) AS runs, max(started_at) AS latest
                          FROM metrics WHERE ? IS NULL OR lane = ? GROUP BY ALL ORDER BY lane, metric""",
                       [lane, lane]).df()
