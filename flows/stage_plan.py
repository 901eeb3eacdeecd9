"""Which of the lane flow's stages a lane runs: chosen by the flow that hands the lane over.

The nightly runs every stage the lane declares; `lanebench tools` boots, runs the boot gates and
the tool gate only (with the held-out suite when asked); a matrix arm measures speed under one
drafter and K, so it skips the target's prefill ladder, tool gate, needle ladder and accuracy
eval (they would cost every arm minutes and are the nightly's business). The boot gates and
the expectations always run: they are what makes a number trustworthy at all.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict


class StagePlan(BaseModel):
    """The optional stages, each still only where the lane declares it."""

    model_config = ConfigDict(frozen=True)

    speed: bool = True  # capacity plan, warmup, decode curve (+ queueing levels), acceptance probe
    prefill: bool = True  # prefill ladder
    tool_gate: bool = True
    needles: bool = True  # needle ladder
    accuracy: bool = True  # accuracy eval
    held_out: bool = False  # the held-out tool suite, only ever when asked (`lanebench tools --held-out`)


NIGHTLY = StagePlan()
MATRIX_ARM = StagePlan(prefill=False, tool_gate=False, needles=False, accuracy=False)


def tools(held_out: bool) -> StagePlan:
    """`lanebench tools`: boot, boot gates and the tool gate."""
    return StagePlan(speed=False, prefill=False, needles=False, accuracy=False, held_out=held_out)
