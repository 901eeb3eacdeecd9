"""Paths a run folder names stay inside the artifacts folder: no symlink followed, no `..`.

Reclaim, history and verify read (and reclaim rewrites) what a run folder lists. A folder is
data anyone with write access can shape: a symlinked run folder or lane folder led reclaim to
rewrite a manifest outside the artifacts folder (issue 27), and a manifest can name `../x`.
Every such path is checked here first and refused with one line, never followed.
"""

from __future__ import annotations

from pathlib import Path, PurePosixPath


class Outside(ValueError):
    """A path that is a symlink or leaves its root: the one line that says which and why."""


def confined(root: Path, rel: str | Path) -> Path:
    """`root / rel`, when `rel` is relative, has no `..`, and neither it nor any folder on the way
    from `root` is a symlink (`root` itself may be one: the user chose it). Raises Outside."""
    parts = PurePosixPath(str(rel)).parts
    if not parts or PurePosixPath(str(rel)).is_absolute() or ".." in parts:
        raise Outside(f"{rel}: leaves {root} (absolute or '..'): not followed")
    path = Path(root)
    for part in parts:
        path = path / part
        if path.is_symlink():
            raise Outside(f"{path}: a symlink, not followed (nothing outside {root} is read or written)")
    return path


def inside(root: Path, path: Path) -> Path:
    """`path` (found under `root` by a glob) checked as `confined` does."""
    return confined(root, Path(path).relative_to(root))
