"""Audit a run folder against its manifest: every file's sha256, nothing missing, nothing extra.

Never raises on what it finds: a bad manifest, a listed path that leaves the folder or is a
symlink, a raw record changed after its run died, a manifest that differs from its signed ledger
entry: each is one line in `problems`, and the audit fails.
"""

from __future__ import annotations

import os
from pathlib import Path

from pydantic import BaseModel

from tasks.hosts.files import file_sha256
from tasks.record.manifest import ManifestError, Outside, confined, read_manifest

# Files the manifest cannot list by hash: itself, the reserve, a dead run's seals (reclaim checks them).
_UNLISTED = {"manifest.json", ".reserve"}
_UNLISTED_DIRS = (".seals/",)


class Audit(BaseModel):
    run: str
    checked: int = 0
    missing: list[str] = []
    changed: list[str] = []
    extra: list[str] = []
    problems: list[str] = []  # one line each: what makes the folder untrustworthy beyond a file's hash
    ledger: str = ""  # the manifest against its signed ledger entry (tasks/record/ledger.py)

    @property
    def ok(self) -> bool:
        return not (self.missing or self.changed or self.extra or self.problems)


def _present(run_dir: Path, result: Audit) -> set[str]:
    """Every file under the folder, symlinks named as problems and never followed."""
    found: set[str] = set()
    for top, dirs, files in os.walk(run_dir, followlinks=False):
        for name in [*dirs, *files]:
            path = Path(top) / name
            rel = str(path.relative_to(run_dir))
            if path.is_symlink():
                result.problems.append(f"symlink: {rel} -> {os.readlink(path)} (not followed)")
            elif name in files:
                found.add(rel)
    return found


def audit(run_dir: Path) -> Audit:
    result = Audit(run=str(run_dir))
    mpath = run_dir / "manifest.json"
    if mpath.is_symlink():
        result.problems.append("manifest.json: a symlink, not followed")
        return result
    try:
        manifest = read_manifest(mpath)
    except ManifestError as e:
        result.problems.append(f"manifest.json: {e.why}; nothing in the folder can be checked")
        return result
    except OSError as e:
        result.problems.append(f"manifest.json: cannot be read ({e.strerror})")
        return result
    listed = {a.path: a.sha256 for a in manifest.artifacts}
    result.checked = len(listed)
    for rel, digest in sorted(listed.items()):
        try:
            path = confined(run_dir, rel)
        except Outside as e:
            result.problems.append(f"listed path {e}")
            continue
        try:
            if not path.is_file():
                result.missing.append(rel)
            elif file_sha256(path) != digest:
                result.changed.append(rel)
        except OSError as e:
            result.problems.append(f"{rel}: cannot be read ({e.strerror})")
    for line in manifest.flow.reclaim.changed_after_crash if manifest.flow.reclaim else []:
        result.problems.append(f"changed after the run died (found by its reclaim): {line}")
    from tasks.record import ledger

    state, why = ledger.check(run_dir)
    result.ledger = f"{state}: {why}"
    if state == "unverified":
        result.problems.append(f"signed ledger: {why}")
    present = _present(run_dir, result)
    result.extra = sorted(p for p in present - set(listed) - _UNLISTED if not p.startswith(_UNLISTED_DIRS))
    return result
