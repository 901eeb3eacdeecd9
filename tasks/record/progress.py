"""Progress display: which lane, which stage, on the terminal that started the run."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from rich.console import Console

_console = Console(stderr=True, highlight=False)
_t0 = time.monotonic()


def progress(lane: str, stage: str) -> None:
    _console.print(f"[dim]{time.monotonic() - _t0:7.1f}s[/dim] [bold cyan]{lane}[/bold cyan] · {stage}")


def say(message: str) -> None:
    _console.print(message)


def written_by(root: str | Path, flow: str, flow_run_id: str) -> Path | None:
    """The folder a flow run wrote under `root` (named `<time>_<flow>_<first 8 of the flow-run id>`)."""
    folders = sorted(Path(root).glob(f"*_{flow}_{flow_run_id[:8]}")) if flow_run_id else []
    return folders[-1] if folders else None


def run_folder_of(state: Any, artifacts: Path, flow: str) -> Path | None:
    return written_by(artifacts, flow, str(state.state_details.flow_run_id or ""))


def closing(state: Any, folder: Path | None, passed: str, failed: str) -> bool:
    """How every flow command ends: its verdict, then `run folder: ...` as the very last line
    (scripts and tests read it). True when the flow run completed."""
    ok = bool(state.is_completed())
    _close(f"[green]{passed}[/green]" if ok else f"[red]{failed}[/red]: {state.message}", folder)
    return ok


def closing_verdict(state: Any, folder: Path | None, flow: str) -> int:
    """Like `closing`, for flows whose final state carries a verdict (tasks/record/verdict.py):
    the verdict's own line, then the run folder; returns the exit code."""
    from tasks.record.verdict import exit_code_of

    code = exit_code_of(state)
    message = str(state.message or "")
    line = message if message.startswith(f"{flow} ") else f"{flow} failed: {message}"
    colour = {0: "green", 3: "yellow", 130: "yellow"}.get(code, "red")
    _close(f"[{colour}]{line}[/{colour}]", folder)
    return code


def _close(verdict: str, folder: Path | None) -> None:
    say(verdict)
    print(f"run folder: {folder if folder else '(none was created)'}")
