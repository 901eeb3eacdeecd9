"""A history that can prove itself: each run's manifest digest, signed, outside the run folder.

A forged manifest with its table and hash rewritten together passed `verify`, and `history` served
its 1154 tok/s beside the lane's 533-814 (issue 27). So a finished (or reclaimed) run's manifest
sha256 is appended to an append-only ledger signed with the user's ed25519 key, both outside any
run folder (`~/.config/lanebench/ledger.key`, mode 0600, and `ledger.jsonl`; LANEBENCH_LEDGER_DIR
moves them). Each entry names the previous entry's digest, so none can be dropped unseen.
"""

from __future__ import annotations

import hashlib
import json
import os
from datetime import UTC, datetime
from pathlib import Path

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from tasks.hosts.files import file_sha256


def _path(name: str) -> Path:
    """`ledger.key` or `ledger.jsonl` in LANEBENCH_LEDGER_DIR (default ~/.config/lanebench)."""
    return Path(os.environ.get("LANEBENCH_LEDGER_DIR") or Path.home() / ".config" / "lanebench") / name


def _private_key() -> Ed25519PrivateKey:
    """The user's signing key, created on first use (only the owner can read it)."""
    path = _path("ledger.key")
    if path.exists():
        key = serialization.load_pem_private_key(path.read_bytes(), password=None)
        if not isinstance(key, Ed25519PrivateKey):
            raise ValueError(f"{path}: not an ed25519 private key")
        return key
    path.parent.mkdir(parents=True, exist_ok=True)
    key = Ed25519PrivateKey.generate()
    pem = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                            serialization.NoEncryption())
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(pem)
    return key


def _body(entry: dict) -> bytes:
    return json.dumps({k: v for k, v in entry.items() if k != "sig"}, sort_keys=True, separators=(",", ":")).encode()


def _lines() -> list[str]:
    try:
        return _path("ledger.jsonl").read_text().splitlines()
    except OSError:
        return []


def record(folder: Path) -> None:
    """Append the signed digest of `folder`'s manifest as it is now (its run has finished)."""
    key = _private_key()
    lines = _lines()
    entry = {"run": folder.name, "manifest_sha256": file_sha256(folder / "manifest.json"),
             "at": datetime.now(UTC).isoformat(), "prev": hashlib.sha256(lines[-1].encode()).hexdigest() if lines else ""}
    entry["sig"] = key.sign(_body(entry)).hex()
    with _path("ledger.jsonl").open("a") as f:
        f.write(json.dumps(entry, sort_keys=True) + "\n")


def check(folder: Path) -> tuple[str, str]:
    """("verified" | "unverified" | "absent", one line why) for a run folder's manifest now."""
    ledger = _path("ledger.jsonl")
    try:
        public = _private_key().public_key() if _path("ledger.key").exists() else None
    except (OSError, ValueError):
        public = None
    latest = None
    for i, line in enumerate(_lines()):
        try:
            entry = json.loads(line)
        except ValueError:
            continue
        if isinstance(entry, dict) and entry.get("run") == folder.name:
            latest = (i, entry)
    if latest is None or public is None:
        return "absent", f"no entry for {folder.name} in the signed ledger {ledger}"
    i, entry = latest
    try:
        public.verify(bytes.fromhex(entry.get("sig", "")), _body(entry))
    except (InvalidSignature, ValueError):
        return "unverified", f"its ledger entry (line {i + 1} of {ledger}) has a bad signature"
    try:
        digest = file_sha256(folder / "manifest.json")
    except OSError as e:
        return "unverified", f"manifest.json cannot be read ({e.strerror})"
    if digest != entry["manifest_sha256"]:
        return "unverified", (f"manifest.json differs from the digest signed when the run finished ({entry['at']}, "
                              f"{ledger}): the folder was rewritten after the fact")
    return "verified", f"manifest matches its signed ledger entry of {entry['at']}"
