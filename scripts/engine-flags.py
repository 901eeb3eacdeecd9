#!/usr/bin/env python3
"""Extract the launch flags of a pinned SGLang or vLLM release from its wheel, without installing it.

    uv run python scripts/engine-flags.py sglang 0.5.23
    uv run python scripts/engine-flags.py vllm 0.33.0
    uv run python scripts/engine-flags.py --all          # every release pinned in tasks/engines/releases.py

Downloads the wheel once into $LANEBENCH_CACHE/wheels (`pip download --no-deps --only-binary=:all:`),
reads its argument definitions with `ast` (tasks/engines/release_flags.py:
from which files, and the parsers' rules for boolean inverses) and writes
tasks/engines/flags/<engine>-<version>.json. Commit that file; run this again when a pin moves.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tasks.engines import release_flags  # noqa: E402
from tasks.engines.releases import PINNED  # noqa: E402


def wheel_for(engine: str, version: str) -> Path:
    if (found := release_flags.cached_wheel(engine, version)) is not None:
        return found
    release_flags.WHEEL_CACHE.mkdir(parents=True, exist_ok=True)
    pip = [sys.executable, "-m", "pip"]
    if subprocess.run([*pip, "--version"], capture_output=True).returncode != 0:
        pip = ["uvx", "--from", "pip", "pip"]  # a uv venv has no pip of its own
    subprocess.run([*pip, "download", "--no-deps", "--only-binary=:all:", f"{engine}=={version}",
                    "-d", str(release_flags.WHEEL_CACHE)], check=True)
    found = release_flags.cached_wheel(engine, version)
    if found is None:
        raise SystemExit(f"engine-flags: pip saved no {engine}-{version} wheel in {release_flags.WHEEL_CACHE}")
    return found


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("engine", nargs="?", choices=sorted(release_flags.SOURCES))
    parser.add_argument("version", nargs="?")
    parser.add_argument("--all", action="store_true", help="every pinned release")
    args = parser.parse_args()
    if args.all:
        wanted = list(PINNED.items())
    elif args.engine and args.version:
        wanted = [(args.engine, args.version)]
    else:
        parser.error("give ENGINE VERSION, or --all")
    release_flags.FLAGS_DIR.mkdir(parents=True, exist_ok=True)
    for engine, version in wanted:
        found = release_flags.extract(engine, wheel_for(engine, version))
        out = release_flags.path_for(engine, found.version)
        out.write_text(found.model_dump_json(indent=1) + "\n")
        print(f"{out}: {len(found.flags)} flags from {len(found.sources)} files of {found.wheel}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
