"""Progress display: which lane, which stage, on the terminal that started the run."""

from __future__ import annotations

import time

from rich.console import Console

_console = Console(stderr=True, highlight=False)
_t0 = time.monotonic()


def progress(lane: str, stage: str) -> None:
    _console.print(f"[dim]{time.monotonic() - _t0:7.1f}s[/dim] [bold cyan]{lane}[/bold cyan] · {stage}")


def say(message: str) -> None:
    _console.print(message)
