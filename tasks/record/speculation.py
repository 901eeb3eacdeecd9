"""Speculation always judged: a speculative lane against the plain lane of the same target.

The seeds' nightly passed a speculative lane at 381/497 tok/s beside the plain lane of its target
at 1418/1127 with no word that speculation loses. Any run holding both now says which is faster at
each shared concurrency. Same target means the same model sha256, and the pair may differ in
nothing but speculation (fingerprints): otherwise NOT COMPARABLE. A run with only a speculative
lane is judged against its last plain baseline in history, or says none exists.
"""

from __future__ import annotations

import json

import pandas as pd

from tasks.record.fingerprint import beyond_speculation, describe_differences
from tasks.record.manifest import LaneRecord
from tasks.record.run_folder import RunFolder


def _speculative(record: LaneRecord) -> bool:
    return bool(record.config.get("drafter") or record.config.get("speculative"))


def _target(record: LaneRecord) -> str | None:
    return next((m.sha256 for m in record.models if m.role == "model"), None)


def _decode(run: RunFolder, lane: str) -> dict[int, float] | None:
    entry = next((a for a in run.manifest.artifacts if a.lane == lane and a.kind == "decode"
                  and a.validation == "passed"), None)
    if entry is None:
        return None
    return {int(r.concurrency): float(r.aggregate_tok_s) for r in pd.read_parquet(run.path / entry.path).itertuples()}


def _judge(s: str, mine: dict[int, float], theirs: dict[int, float], against: str) -> list[str]:
    shared = sorted(set(mine) & set(theirs))
    if not shared:
        return [f"no verdict on speculation for {s} against {against}: no concurrency level in common"]
    out = []
    for c in shared:
        a, b = mine[c], theirs[c]
        change = f"{100 * (a / b - 1):+.0f}%" if b > 0 else "n/a"
        word = "SPECULATION LOSES" if a < b else "speculation wins"
        out.append(f"{word} at C={c}: {s} {a:.1f} tok/s against {b:.1f} tok/s for {against} ({change})")
    return out


def last_plain_baseline(run: RunFolder, lane: str) -> tuple[str, str, dict[int, float]] | None:
    """(run, lane, aggregate tok/s per concurrency) of the newest earlier run of this flow in the
    same artifacts root where a plain lane passed that differs from `lane` only in speculation."""
    from tasks.record.history import open_index
    from tasks.record.regression import _fingerprint_of

    record = run.manifest.lanes[lane]
    with open_index(run.path.parent) as con:
        candidates = con.execute(
            """SELECT l.run, l.lane, l.config FROM lanes l JOIN runs r ON r.run = l.run
               WHERE r.flow = ? AND l.run <> ? AND r.started_at < (SELECT started_at FROM runs WHERE run = ?)
                 AND l.status = 'passed' AND l.model_sha256 = ? AND l.drafter_sha256 IS NULL
               ORDER BY r.started_at DESC""",
            [run.manifest.flow.name, run.path.name, run.path.name, _target(record)]).fetchall()
        prints: dict[str, dict[str, str]] = {}
        for earlier, name, config in candidates:
            if json.loads(config or "{}").get("speculative") or \
                    beyond_speculation(record.fingerprint, _fingerprint_of(con, earlier, name, prints)):
                continue
            rows = con.execute("SELECT concurrency, aggregate_tok_s FROM decode WHERE run = ? AND lane = ?",
                               [earlier, name]).fetchall()
            if rows:
                return earlier, name, {int(c): float(t) for c, t in rows}
        return None


def speculation_verdicts(run: RunFolder) -> list[str]:
    """`SPECULATION LOSES at C=2: ...` or `speculation wins ...` per speculative lane, plain lane of its
    target and shared concurrency (aggregate tok/s); `NOT COMPARABLE: ...` for a pair that differs beyond speculation."""
    passed = {n: r for n, r in run.manifest.lanes.items() if r.status == "passed"}
    spec = [n for n, r in passed.items() if _speculative(r)]
    plain = [n for n, r in passed.items() if not _speculative(r)]
    out: list[str] = []
    for s in spec:
        target = _target(passed[s])
        pairs = [p for p in plain if target is not None and _target(passed[p]) == target]
        mine = _decode(run, s) or {}
        for p in pairs:
            if passed[s].fingerprint and passed[p].fingerprint and \
                    (diffs := beyond_speculation(passed[s].fingerprint, passed[p].fingerprint)):
                out.append(f"NOT COMPARABLE: {s} against {p} (plain, same target) differs beyond speculation: "
                           f"{describe_differences(diffs)}; no verdict on speculation from this pair; fix: give "
                           f"both lanes the same settings but the drafter")
                continue
            out += _judge(s, mine, _decode(run, p) or {}, f"{p} (plain, same target)")
        if pairs:
            continue
        found = last_plain_baseline(run, s) if passed[s].fingerprint else None
        if found is None:
            out.append(f"no verdict on speculation for {s}: no plain lane of the same target (model sha256 "
                       f"{str(target)[:12]}...) passed in this run, and no plain baseline exists (no earlier "
                       f"{run.manifest.flow.name} run here has a plain lane that differs from it only in speculation)")
            continue
        earlier, name, theirs = found
        out += _judge(s, mine, theirs, f"{name} in {earlier} (last plain baseline)")
    return out
