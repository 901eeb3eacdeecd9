"""Engine releases and the log format each version range prints (released engines change their lines:
SGLang 0.5.23 `server_args={...}` for `server_args=ServerArgs(...)`; vLLM 0.33.0 `GPU + host KV cache
size`, and no "Loading drafter model" under Model Runner V2). An unknown version tries every format."""

from __future__ import annotations

import re

from pydantic import BaseModel, ConfigDict

# The releases whose source the adapters and their launch flags were checked against
# (scripts/engine-flags.py extracts each one's flags into tests/fixtures/engines/flags/).
PINNED = {"sglang": "0.5.23", "vllm": "0.33.0"}


def version_key(version: str) -> tuple[int, ...]:
    """'0.5.23rc1' -> (0, 5, 23): the numeric release parts, enough to order releases."""
    m = re.match(r"v?(\d+(?:\.\d+)*)", version)
    return tuple(int(p) for p in m[1].split(".")) if m else ()


class Format(BaseModel):
    """One log format and the releases that print it: `since` inclusive, `until` exclusive."""

    model_config = ConfigDict(frozen=True)

    name: str
    since: str | None = None
    until: str | None = None

    def covers(self, version: str | None) -> bool:
        if version is None:
            return True
        key = version_key(version)
        return (self.since is None or key >= version_key(self.since)) and (self.until is None or key < version_key(self.until))


def formats_for(formats: list[Format], version: str | None) -> list[Format]:
    """The formats a version prints, newest first; every format when the version is unknown
    (or newer than any range names, so a release we have not read still parses)."""
    chosen = [f for f in formats if f.covers(version)]
    return chosen or list(formats)
