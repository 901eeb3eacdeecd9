"""Audit a run folder against its manifest: every file's sha256, nothing missing, nothing extra."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from pydantic import BaseModel

# Files the manifest cannot list by hash: itself.
_UNLISTED = {"manifest.json", ".reserve"}  # the reserve: freed space for a last manifest (tasks/record/run_folder.py)


class Audit(BaseModel):
    run: str
    checked: int
    missing: list[str] = []
    changed: list[str] = []
    extra: list[str] = []

    @property
    def ok(self) -> bool:
        return not (self.missing or self.changed or self.extra)


def audit(run_dir: Path) -> Audit:
    manifest = json.loads((run_dir / "manifest.json").read_text())
    listed = {a["path"]: a["sha256"] for a in manifest["artifacts"]}
    result = Audit(run=str(run_dir), checked=len(listed))
    for rel, digest in sorted(listed.items()):
        path = run_dir / rel
        if not path.is_file():
            result.missing.append(rel)
        elif hashlib.sha256(path.read_bytes()).hexdigest() != digest:
            result.changed.append(rel)
    present = {str(p.relative_to(run_dir)) for p in run_dir.rglob("*") if p.is_file()}
    result.extra = sorted(present - set(listed) - _UNLISTED)
    return result
