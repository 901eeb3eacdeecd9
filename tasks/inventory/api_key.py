"""A lane's API key, by reference only: `api_key_env: NAME` (lanebench's environment) or `api_key_file:
PATH` (relative to the inventory; the first line not a `#` comment). It reaches the server in the
engine's variable (`LaneRules.api_key_env`), never its argv, and every request as `Authorization: Bearer`
(tasks/client/auth.py). Refused at load: an inline `api_key`, `--api-key`/`--api-key-file` in flags,
the engine's key variable under `env`, and a key for an engine taking one only on its command line.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from tasks.inventory import secrets
from tasks.inventory.base import _RefError
from tasks.inventory.flag_conflicts import RULES
from tasks.inventory import paths

_FIX = "export the key in lanebench's environment and name it: api_key_env: LANE_API_KEY (or api_key_file: PATH)"


class KeyUnavailable(RuntimeError):
    """The lane's key cannot be had where it says it is: the lane's reason to be skipped."""


def refuse_inline(data: Any) -> Any:
    """A lane mapping that writes its key inline (a pydantic before-validator's body)."""
    if isinstance(data, dict) and "api_key" in data:
        raise _RefError(".api_key", "a key written in the inventory is copied, committed and recorded with it", _FIX)
    return data


def check(lane: Any) -> None:
    """The declaration's own problems (the key's value is not looked at here)."""
    if lane.api_key_env is not None and lane.api_key_file is not None:
        raise _RefError(".api_key_file", "api_key_env and api_key_file both name the key", "keep one of them")
    for i, flag in enumerate(lane.flags):
        if flag.split("=", 1)[0] in ("--api-key", "--api-key-file"):
            raise _RefError(f".flags[{i}]", f"{flag.split('=', 1)[0]} puts the server's key on its command line "
                            "(ps and /proc show it), and lanebench's client would not send it", _FIX)
    var = RULES[lane.engine].api_key_env
    if var is not None and var in lane.env:
        raise _RefError(f".env.{var}", f"{var} is the server's API key, written in the inventory", _FIX)
    if var is None and (lane.api_key_env or lane.api_key_file):
        field = ".api_key_env" if lane.api_key_env else ".api_key_file"
        raise _RefError(field, f"engine {lane.engine} takes an API key only on its command line, where every "
                        "user of the host reads it", "serve this lane without a key, behind a host-local address")


def resolve(lane: Any, base_dir: Path) -> str | None:
    """The key's value (None: the lane has no key); raises KeyUnavailable naming where it looked."""
    if lane.api_key_env is not None:
        value = os.environ.get(lane.api_key_env, "").strip()
        if not value:
            raise KeyUnavailable(f"api_key_env {lane.api_key_env} is not set in lanebench's environment "
                                 f"(export {lane.api_key_env}=... where lanebench and its workers run)")
        return _checked(value, f"${lane.api_key_env}")
    if lane.api_key_file is not None:
        path = paths.resolve(base_dir, lane.api_key_file)
        try:
            lines = path.read_text().splitlines()
        except OSError as e:
            raise KeyUnavailable(f"api_key_file {path} cannot be read ({e.strerror})") from None
        value = next((ln.strip() for ln in lines if ln.strip() and not ln.lstrip().startswith("#")), "")
        if not value:
            raise KeyUnavailable(f"api_key_file {path} holds no key (one line, not starting with #)")
        return _checked(value, str(path))
    return None


def _checked(value: str, where: str) -> str:
    if any(c.isspace() or not c.isprintable() for c in value) or "," in value:
        # llama-server splits --api-key at commas; a header cannot carry a newline
        raise KeyUnavailable(f"the key in {where} holds whitespace, a comma or a control character")
    secrets.remember_value(value)  # scrubbed from whatever this process writes from now on
    return value
