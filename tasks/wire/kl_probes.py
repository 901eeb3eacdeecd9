"""Typed records of the KL gate: teacher-forced probes, their scores, and the result tables.

Words follow the seeds' instrument: the *reference* generates greedy tokens, each *candidate*
scores exactly those tokens teacher-forced, and the gate compares per-token log-probabilities
(|Δlogprob|) and argmaxes ("argmax flips": the candidate's most likely token is not the
reference's token).
"""

from __future__ import annotations

from typing import Literal

from tasks.wire.base import Record


class ForcedProbe(Record):
    """One HTTP request that scores `positions` of a token sequence teacher-forced; `forced[i]` is the
    token read at `positions[i]`. SGLang and vLLM score a sequence in one request, llama.cpp per position."""

    path: str
    body: dict
    positions: list[int]
    forced: list[int]


class ForcedScore(Record):
    """The model's view of one forced position: log p(forced token | prefix) and its own argmax."""

    position: int
    logprob: float
    argmax: int


class ProbeRetry(Exception):
    """The engine answered without the numbers asked for; send this probe instead. llama.cpp withholds
    the probabilities of a sampled lone byte token (incomplete UTF-8); the retry samples a harmless
    token and reads the forced one from the full list."""

    def __init__(self, probe: ForcedProbe) -> None:
        super().__init__("retry with another probe")
        self.probe = probe


class Sequence(Record):
    """A prompt's tokens (as the reference tokenized it) and the reference's greedy continuation."""

    prompt_id: str
    context: list[int]
    continuation: list[int]
    text: str = ""

    @property
    def tokens(self) -> list[int]:
        return self.context + self.continuation


Scoring = Literal["reference-1", "reference-2", "candidate"]
KlRole = Literal["reference", "candidate"]
KlStatus = Literal["complete", "partial", "refused", "skipped", "failed"]
KlVerdict = Literal["pass", "fail", "exact", "inexact", "no verdict"]


class ScoreRecord(Record):
    """Raw record, appended per prompt as it is scored (kept when a lane dies mid-way)."""

    lane: str
    scoring: Scoring
    prompt_id: str
    positions: list[int]  # index into the continuation
    logprobs: list[float]
    argmax: list[int]
    seconds: float


class KlPositionRow(Record):
    """One scored continuation position of one lane, beside the reference's first scoring (for the
    reference lane, its second scoring against its first: the exactness check)."""

    lane: str
    prompt_id: str
    position: int
    token: int  # the reference's greedy token at this position
    ref_logprob: float
    ref_argmax: int
    logprob: float
    argmax: int
    abs_dlogprob: float
    flip: bool  # argmax != token


class KlSummaryRow(Record):
    lane: str
    role: KlRole
    status: KlStatus
    prompts: int
    positions: int
    positions_expected: int
    mean_abs_dlogprob: float | None
    median_abs_dlogprob: float | None
    p95_abs_dlogprob: float | None
    max_abs_dlogprob: float | None
    argmax_flip_share: float | None
    verdict: KlVerdict
    reason: str = ""


class KlPairRow(Record):
    """Two candidates on the positions both scored. `gap_*` is a minus b, each against the reference
    (negative: a is closer), with a paired-bootstrap confidence interval over prompts."""

    lane_a: str
    lane_b: str
    prompts: int
    positions: int
    mean_abs_dlogprob: float  # |logprob_a - logprob_b|
    median_abs_dlogprob: float
    p95_abs_dlogprob: float
    argmax_differs_share: float  # argmax_a != argmax_b
    same_wrong_flip_share: float  # both flip, to the same wrong token
    gap_mean_abs_dlogprob: float
    gap_ci_low: float
    gap_ci_high: float
    gap_ci_excludes_zero: bool
    gap_flip_share: float
    gap_flip_ci_low: float
    gap_flip_ci_high: float
    a_closer_prompts: int
    resamples: int
    seed: int
