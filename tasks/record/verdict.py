"""The night's verdict from the lanes' end states: one closing line and one exit code, for every flow.

    0  passed            every lane that ran passed (lanes skipped by a precondition are named)
    1  failed            a gate, a bar, an expectation or a regression failed
    2  bad input         (the CLI, before anything runs)
    3  nothing measured  every lane was skipped by a precondition: the boxes were not ready
    130 interrupted      Ctrl-C or SIGTERM (128 + SIGINT, the shell's convention)

Nothing measured is no pass, no bad number (1) and no bad file (2): a script can page for it
apart. A failed lane outranks an interrupted one, which outranks nothing measured.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel

from tasks.record.manifest import FlowVerdict, LaneRecord

Outcome = Literal["passed", "failed", "nothing-measured", "interrupted"]
EXIT_CODES: dict[str, int] = {"passed": 0, "failed": 1, "nothing-measured": 3, "interrupted": 130}


class Verdict(BaseModel):
    outcome: Outcome
    line: str  # the closing line, without the run folder

    @property
    def exit_code(self) -> int:
        return EXIT_CODES[self.outcome]

    def recorded(self) -> FlowVerdict:
        """What the manifest keeps of it: `flow.verdict`."""
        return FlowVerdict(outcome=self.outcome, exit_code=self.exit_code, line=self.line)


def night_verdict(flow: str, lanes: dict[str, LaneRecord], problems: list[str]) -> Verdict:
    """`problems`: failures beyond the lanes (regressions, a report that could not be written)."""
    by: dict[str, list[str]] = {"passed": [], "failed": [], "skipped": [], "interrupted": []}
    for name, r in lanes.items():  # a lane still running or interrupted did not finish
        by[r.status if r.status in ("passed", "failed", "skipped") else "interrupted"].append(name)
    counts = ", ".join(f"{len(names)} {word}" for word, names in by.items() if names) or "no lane"
    skipped = ": " + "; ".join(f"{n} skipped: {lanes[n].reason}" for n in by["skipped"]) if by["skipped"] else ""
    if by["failed"] or problems:
        why = "; ".join([f"{n}: {lanes[n].reason}" for n in by["failed"]] + problems)
        return Verdict(outcome="failed", line=f"{flow} failed ({counts}): {why}")
    if by["interrupted"]:
        return Verdict(outcome="interrupted", line=f"{flow} interrupted ({counts}): what was measured so far is kept")
    if not by["passed"]:
        return Verdict(outcome="nothing-measured", line=f"{flow} measured nothing ({counts}){skipped}")
    return Verdict(outcome="passed", line=f"{flow} passed ({counts}){skipped}")


# Prefect has no Skipped or NothingMeasured state: a completed flow run carries the outcome in its state name.
STATE_NAMES: dict[str, str] = {"passed": "Completed", "nothing-measured": "NothingMeasured",
                               "interrupted": "Interrupted"}


def exit_code_of(state: Any) -> int:
    """The exit code a flow run's final state stands for (see the table above)."""
    if state.is_completed():
        by_name = {v: k for k, v in STATE_NAMES.items()}
        return EXIT_CODES[by_name.get(state.name, "passed")]
    if state.name == "Interrupted" or state.is_cancelled():
        return EXIT_CODES["interrupted"]
    return EXIT_CODES["failed"]
