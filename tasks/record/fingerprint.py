"""A lane's fingerprint: everything recorded that can move one of its numbers, flat (field -> value).

The seeds' nightly judged a -50.8 % change "no change" after the model file at the same path was
replaced, and kept an earlier engine build's nights as baseline after an in-place upgrade. Held:
model and drafter sha256, engine identity, launch argv (files by content, no port), the settings
the server resolved (no timings), the bench plan (prompt sets by content) and the host's hardware.
"""

from __future__ import annotations

import re
import shlex
from contextlib import suppress
from pathlib import Path
from typing import Any

from tasks.hosts.files import sha256_of
from tasks.record.manifest import HostFacts, LaneRecord

# Boot facts that say how a boot went, not what it serves: per-source readings, timings.
_BOOT_NOISE = {"sources", "disagreements", "cap_source", "extra"}
_PORT = re.compile(r"^--?(port|master-port)$")


def flat(d: Any, prefix: str = "") -> dict[str, str]:
    """Nested dicts as `a.b.c` -> repr(value)."""
    if isinstance(d, dict):
        out: dict[str, str] = {}
        for k, v in sorted(d.items()):
            out |= flat(v, f"{prefix}.{k}" if prefix else str(k))
        return out
    return {prefix: repr(d)}


def _by_content(value: Any, base_dir: Path | None, known: dict[str, str]) -> Any:
    """A path to an existing file, as its content sha256 (a prompt set copied elsewhere is the
    same set; one edited in place is not); anything else as it is."""
    if isinstance(value, dict):
        return {k: _by_content(v, base_dir, known) for k, v in value.items()}
    if isinstance(value, list):
        return [_by_content(v, base_dir, known) for v in value]
    if not isinstance(value, str) or "/" not in value and "." not in value:
        return value
    if value in known:
        return f"sha256:{known[value]}"
    path = Path(value)
    if not path.is_absolute() and base_dir is not None:
        from tasks.inventory.load import shipped_or_local

        path = shipped_or_local(base_dir, value)
    with suppress(OSError):
        if path.is_file() and path.stat().st_size < 1 << 30:  # models are known by their recorded sha256
            return f"sha256:{sha256_of(path)}"
    return value


def _argv(command: str, known: dict[str, str], base_dir: Path | None) -> str:
    try:
        words = shlex.split(command)
    except ValueError:
        return command
    return " ".join(str(_by_content(word, base_dir, known)) if word.startswith(("/", ".")) or "/" in word else word
                    for before, word in zip(["", *words], words) if not (_PORT.match(word) or _PORT.match(before)))


def fingerprint(record: LaneRecord, host: HostFacts, base_dir: Path | None = None) -> dict[str, str]:
    """The fingerprint of one lane's record on `host` (the manifest's host facts). `base_dir`:
    where the inventory's relative paths start."""
    known = {m.path: m.sha256 for m in record.models if m.sha256 is not None}
    out = {f"{m.role}.sha256": str(m.sha256) for m in record.models}
    out.setdefault("drafter.sha256", "none")
    out |= {f"engine.{k}": str(v) for k, v in sorted(record.engine_identity.items()) if k != "path"}
    out |= {f"image.{k}": str(record.image[k]) for k in ("digest", "image_id", "id") if record.image.get(k)}
    out["launch"] = _argv(record.launch_command, known, base_dir)
    facts = record.boot_facts
    extra = facts.get("extra")
    out |= flat({k: v for k, v in facts.items() if k not in _BOOT_NOISE}, "server")
    out |= flat(_by_content({k: v for k, v in (extra if isinstance(extra, dict) else {}).items()
                              if not re.search(r"(_s|_ms|_seconds)$", k)}, base_dir, known), "server")
    out |= flat(_by_content(record.config.get("bench") or {}, base_dir, known), "bench")
    return out | {f"host.{k}": str(getattr(host, k)) for k in ("machine", "cpu", "cores", "memory_gib")}


def differences(current: dict[str, str], other: dict[str, str]) -> list[tuple[str, str | None, str | None]]:
    """(field, other's value, current value) for each field that differs, in field order."""
    keys = sorted(set(current) | set(other))
    return [(k, other.get(k), current.get(k)) for k in keys if current.get(k) != other.get(k)]


# What speculation itself changes; the launch is compared without speculation's own flags, so
# `-ctk q8_0` or another `--ctx-size` differs beyond speculation.
_SPECULATION_FIELDS = re.compile(r"^(drafter\.|bench\.acceptance|server\.(speculative_type|draft_model|num_spec_tokens|"
                                 r"speculative|kv_max_concurrency|kv_cache_tokens))")
_SPEC_FLAG = re.compile(r"^(--spec|--draft|--model-draft$|-md$|--threads-draft|--threads-batch-draft|--n-gpu-layers-draft"
                        r"|-ngld$|--device-draft|-devd$|--ctx-size-draft|-cd$|--cache-type-[kv]-draft|--speculative)")


def without_speculation(launch: str) -> str:
    """The launch words with speculation's own flags and their values removed."""
    words, out, i = launch.split(" "), [], 0
    while i < len(words):
        flag = words[i]
        if _SPEC_FLAG.match(flag):
            takes_value = "=" not in flag and i + 1 < len(words) and not words[i + 1].startswith("--")
            i += 2 if takes_value else 1
            continue
        out.append(flag)
        i += 1
    return " ".join(out)


def beyond_speculation(arm: dict[str, str], plain: dict[str, str]) -> list[tuple[str, str | None, str | None]]:
    """Differences between a speculative arm and the no-speculation arm other than speculation's own.
    A server setting only one side states is no difference: llama-server reports a slot's sampling
    only once a request ran on it, and the speculative lane's probe ran before its facts were read."""
    strip = {"launch": without_speculation}
    a = {k: strip.get(k, str)(v) for k, v in arm.items()}
    b = {k: strip.get(k, str)(v) for k, v in plain.items()}
    return [d for d in differences(a, b) if not _SPECULATION_FIELDS.match(d[0])
            and not (d[0].startswith("server.") and None in (d[1], d[2]))]


def _launch_change(before: str, after: str) -> str:
    """Only the argv words that differ: `--ctx-size 1024 -> --ctx-size 512`, `(absent) -> -ctk q8_0`."""
    from difflib import SequenceMatcher

    a, b = before.split(" "), after.split(" ")
    parts = []
    for op, i1, i2, j1, j2 in SequenceMatcher(a=a, b=b, autojunk=False).get_opcodes():
        if op != "equal":
            lead = a[i1 - 1:i1] if i1 and a[i1 - 1].startswith("-") and not " ".join(a[i1:i2]).startswith("-") else []
            parts.append(f"{' '.join(lead + a[i1:i2]) or '(absent)'} -> {' '.join(lead + b[j1:j2]) or '(absent)'}")
    return ", ".join(parts)


def describe_differences(diffs: list[tuple[str, str | None, str | None]], limit: int = 4) -> str:
    """`model.sha256: 'aaaa…' -> 'bbbb…'; launch: -ctk f16 -> -ctk q8_0; ...` (long values cut to
    16 characters; a launch by the words that differ)."""
    def cut(v: str | None) -> str:
        return "(absent)" if v is None else (v if len(v) <= 24 else v[:16] + "...")

    text = "; ".join(f"{k}: {_launch_change(a, b)}" if k == "launch" and a and b else f"{k}: {cut(a)} -> {cut(b)}"
                     for k, a, b in diffs[:limit])
    return text + (f" (and {len(diffs) - limit} more)" if len(diffs) > limit else "")
