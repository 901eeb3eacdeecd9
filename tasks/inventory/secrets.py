"""Secrets never written: redacted everywhere lanebench writes, real only where a process needs them.

A lane's secrets are the env and flag values it names under `secrets`, plus env names ending in
_TOKEN, _KEY, _SECRET, _PASSWORD and flags --api-key, --*-token, --*-key, --*-secret, --password.
Everything recorded (manifest, report.md, Prefect parameters, logs, boot logs after teardown) sees
`REDACTED`; the real lane stays in this process (`keep`) and the lane flow takes it back (`reveal`).
"""

from __future__ import annotations

import math
import re
from collections import Counter
from pathlib import Path
from typing import Any

REDACTED = "REDACTED"
# Values that look like credentials whatever their name (issue 27: an `--alias sk-...` reached the
# manifest, report.md and Prefect's database): token prefixes, long high-entropy strings. `not_secrets`
# keeps a flag's or variable's value in clear.
_TOKEN_PREFIX = re.compile(r"^(sk-|sk_|hf_|ghp_|gho_|ghs_|ghu_|github_pat_|glpat-|xox[abprs]-|AKIA|ASIA|eyJ)"
                           r"[A-Za-z0-9_\-.=+/]{8,}$")
_LONG_TOKEN = re.compile(r"^[A-Za-z0-9_\-+=]{32,}$")  # no '/', '.' or ':': paths, hosts and URLs are not tokens
_HEX_DIGEST = re.compile(r"^(sha256:)?[0-9a-f]{40}$|^(sha256:)?[0-9a-f]{64}$")  # digests are identities, not secrets
_ENV_NAME = re.compile(r"(^|_)(TOKEN|KEY|SECRET|PASSWORD|PASSWD)$")
_FLAG_NAME = re.compile(r"^--(api-key|password|[a-z0-9-]*-(token|key|secret|password))$")

_REAL: dict[str, Any] = {}  # lane name -> the real Lane, this process only
_VALUES: set[str] = set()  # every secret value seen, for scrubbing text


def _declared(lane: Any) -> set[str]:
    return set(getattr(lane, "secrets", None) or [])


def _allowed(lane: Any) -> set[str]:
    return set(getattr(lane, "not_secrets", None) or [])


def _entropy(value: str) -> float:
    counts = Counter(value)
    return -sum(n / len(value) * math.log2(n / len(value)) for n in counts.values())


def looks_secret(value: str) -> bool:
    """A credential by its shape: a known token prefix, or 32+ token characters of high entropy
    mixing letters and digits (a hex digest is an identity and is kept; hyphenated words are not)."""
    if _TOKEN_PREFIX.match(value):
        return True
    return (bool(_LONG_TOKEN.match(value)) and not _HEX_DIGEST.match(value) and _entropy(value) >= 3.5
            and any(c.isdigit() for c in value) and any(c.isalpha() for c in value))


def is_secret_env(lane: Any, key: str, value: str = "") -> bool:
    return key in _declared(lane) or (key not in _allowed(lane) and (bool(_ENV_NAME.search(key)) or looks_secret(value)))


def is_secret_flag(lane: Any, flag: str) -> bool:
    return flag in _declared(lane) or bool(_FLAG_NAME.match(flag))


def _redact_flags(lane: Any, flags: list[str]) -> tuple[list[str], list[str]]:
    """(flags as they may be written, the secret values taken out)."""
    out, values, hide_next, previous = [], [], False, ""
    for flag in flags:
        name, eq, value = flag.partition("=")
        if hide_next or (looks_secret(flag) and previous not in _allowed(lane)):
            out.append(REDACTED)
            values.append(flag)
            hide_next = False
        elif eq and name.startswith("-") and (is_secret_flag(lane, name) or (looks_secret(value) and name not in _allowed(lane))):
            out.append(f"{name}={REDACTED}")
            values.append(value)
        else:
            hide_next = is_secret_flag(lane, flag)
            out.append(flag)
        previous = flag
    return out, values


def _node_envs(lane: Any) -> dict[str, dict[str, str]]:
    nodes = getattr(lane, "nodes", None)
    return dict(getattr(nodes, "env", None) or {})


def secret_values(lane: Any) -> list[str]:
    envs = [lane.env or {}, *_node_envs(lane).values()]
    values = [v for env in envs for k, v in env.items() if is_secret_env(lane, k, v)]
    values += _redact_flags(lane, list(lane.flags))[1]
    return [v for v in values if v and v != REDACTED]


def redact_env(lane: Any, env: dict[str, str]) -> dict[str, str]:
    """An environment as it may be written or printed: secret values replaced by REDACTED."""
    return {k: (REDACTED if is_secret_env(lane, k, v) else v) for k, v in env.items()}


def redact(lane: Any) -> Any:
    """The lane as it may be written: secret env and flag values replaced by REDACTED."""
    update: dict[str, Any] = {"env": redact_env(lane, lane.env or {}), "flags": _redact_flags(lane, list(lane.flags))[0]}
    if node_envs := _node_envs(lane):
        update["nodes"] = lane.nodes.model_copy(update={"env": {h: redact_env(lane, e) for h, e in node_envs.items()}})
    return lane.model_copy(update=update)


def redact_argv(lane: Any, argv: list[str]) -> list[str]:
    """A command line as it may be printed: values of secret flags replaced by REDACTED."""
    return _redact_flags(lane, argv)[0]


def keep(name: str, lane: Any) -> Any:
    """Remember the real lane in this process; returns the redacted one to pass on."""
    _REAL[name] = lane
    _VALUES.update(secret_values(lane))
    return redact(lane)


def keep_inventory(inventory: Any) -> Any:
    lanes = {name: keep(name, lane) for name, lane in inventory.lanes.items()}
    return inventory.model_copy(update={"lanes": lanes})


def reveal(name: str, lane: Any) -> Any:
    """The real lane behind a redacted one (the same lane, kept by this process), else `lane` itself."""
    if (real := _REAL.get(name)) is not None and redact(real) == lane:
        return real
    _VALUES.update(secret_values(lane))
    return lane


def remember(inventory: Any) -> None:
    """Know every lane's secret values from the moment the inventory is read, so any text about
    any lane (an error before its flow starts, another lane's log) can be scrubbed."""
    for lane in inventory.lanes.values():
        _VALUES.update(secret_values(lane))


def remember_value(value: str) -> None:
    """A secret that is not in any lane's text (a lane's API key, read from where it points)."""
    _VALUES.add(value)


def known_values() -> list[str]:
    """The secret values `scrub` replaces, longest first (a value inside another is not cut in two)."""
    return sorted((v for v in _VALUES if len(v) >= 4), key=len, reverse=True)


def scrub(text: str) -> str:
    for value in known_values():
        text = text.replace(value, REDACTED)
    return text


def scrub_file(path: Path) -> None:
    """Rewrite a log the server wrote, with every secret value replaced."""
    if not _VALUES or not path.is_file():
        return
    text = path.read_text(errors="replace")
    if (clean := scrub(text)) != text:
        path.write_text(clean)
