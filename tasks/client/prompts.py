"""Prompt sets: JSONL files of {id, class, prompt}, and the leading nonce.

Every measured prompt starts with a fresh nonce so that no prefix cache can serve a
prompt, or part of one, that an earlier request already computed.
"""

from __future__ import annotations

import json
import secrets
from pathlib import Path

from pydantic import BaseModel


class Prompt(BaseModel):
    id: str
    prompt_class: str
    text: str


def load_prompts(path: str | Path, limit: int | None = None) -> list[Prompt]:
    rows = [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]
    prompts = [Prompt(id=r["id"], prompt_class=r["class"], text=r["prompt"]) for r in rows]
    return prompts[:limit] if limit else prompts


def nonce() -> str:
    return secrets.token_hex(6)


def with_nonce(text: str, tag: str) -> str:
    """The nonce leads the prompt: a cache keyed on any prefix misses from the first token."""
    return f"[{tag}] {text}"
