"""Speculation always judged: a speculative lane against the plain lane of the same target.

In the seeds' nightly a speculative lane at 381/497 tok/s and the plain lane of the same target
at 1418/1127 tok/s were both "passed" with no word that speculation loses: only the matrix
compared with no speculation. Any run holding both now says, at each concurrency the two share,
which is faster. Same target means the same model bytes (sha256), not the same file name; a
speculative lane whose target no plain lane serves gets "no verdict", never silence.
"""

from __future__ import annotations

import pandas as pd

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


def speculation_verdicts(run: RunFolder) -> list[str]:
    """One line per speculative lane, plain lane of the same target and shared concurrency:
    `SPECULATION LOSES at C=2: ...` or `speculation wins at C=1: ...` (aggregate tok/s)."""
    passed = {n: r for n, r in run.manifest.lanes.items() if r.status == "passed"}
    spec = [n for n, r in passed.items() if _speculative(r)]
    plain = [n for n, r in passed.items() if not _speculative(r)]
    out: list[str] = []
    for s in spec:
        target = _target(passed[s])
        pairs = [p for p in plain if target is not None and _target(passed[p]) == target]
        if not pairs:
            out.append(f"no verdict on speculation for {s}: no plain lane of the same target (model sha256 "
                       f"{str(target)[:12]}...) passed in this run")
            continue
        mine = _decode(run, s) or {}
        for p in pairs:
            theirs = _decode(run, p) or {}
            shared = sorted(set(mine) & set(theirs))
            if not shared:
                out.append(f"no verdict on speculation for {s} against {p}: no concurrency level in common")
            for c in shared:
                a, b = mine[c], theirs[c]
                change = f"{100 * (a / b - 1):+.0f}%" if b > 0 else "n/a"
                word = "SPECULATION LOSES" if a < b else "speculation wins"
                out.append(f"{word} at C={c}: {s} {a:.1f} tok/s against {b:.1f} tok/s for {p} "
                           f"(plain, same target) ({change})")
    return out


__all__ = ["speculation_verdicts"]
