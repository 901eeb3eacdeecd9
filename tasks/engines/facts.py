"""What a server says about itself: boot facts, a metrics scrape, acceptance over a window."""

from __future__ import annotations

from typing import Literal

from tasks.wire.base import Record as _Record

Reading = str | int | float | bool | None


class BootFacts(_Record):
    """What the server itself says about how it booted (log, info endpoint, counters; never our flags).
    Each fact is kept per source (`sources`: one log line that changed shape must not decide a gate);
    `reconcile` keeps the most conservative reading (the lowest cap, from `cap_source`; a drafter loaded
    only when no source says not) and lists conflicts in `disagreements`."""

    max_running_requests: int | None = None
    context_per_slot: int | None = None
    speculative_type: str | None = None
    draft_model_loaded: bool = False
    version: str | None = None  # the engine release that booted (log line, /server_info or /version)
    # Deployment shape the cap was scaled by: data-parallel workers, tensor and pipeline widths.
    parallel: dict[str, int] = {}
    sources: dict[str, dict[str, Reading]] = {}
    disagreements: list[str] = []
    cap_source: str | None = None
    extra: dict[str, str | int | float | bool] = {}

    def note(self, fact: str, source: str, value: Reading) -> None:
        """Record one source's reading of a fact (None: the source was asked and did not say)."""
        if value is not None:
            self.sources.setdefault(fact, {})[source] = value

    def info_version(self, version: object, source: str) -> None:
        """The info endpoint's release beside the log's (a different one is a disagreement)."""
        if isinstance(version, str):
            if self.version is not None and self.version != version:
                self.disagreements.append(f"version: log {self.version}, {source} {version}")
            self.version = self.extra["version"] = version

    def reconcile(self) -> BootFacts:
        """Fold the per-source readings into the headline facts, most conservative first."""
        caps = {s: v for s, v in self.sources.get("max_running_requests", {}).items() if isinstance(v, int)}
        if caps:
            source = min(caps, key=lambda s: caps[s])
            self.max_running_requests, self.cap_source = caps[source], source
        if specs := {s: str(v) for s, v in self.sources.get("speculative_type", {}).items()}:
            self.speculative_type = next(iter(specs.values()))
        if drafts := {s: bool(v) for s, v in self.sources.get("draft_model_loaded", {}).items()}:
            self.draft_model_loaded = all(drafts.values())
        own = ("running-request cap:", "speculation type:", "draft model loaded:")
        self.disagreements = [d for d in self.disagreements if not d.startswith(own)]
        if len(set(caps.values())) > 1:
            shown = ", ".join(f"{s} {v}" for s, v in sorted(caps.items()))
            self.disagreements.append(f"running-request cap: {shown}; kept the lowest ({self.cap_source})")
        if len({v.lower() for v in specs.values()}) > 1:
            shown = ", ".join(f"{s} {v}" for s, v in sorted(specs.items()))
            self.disagreements.append(f"speculation type: {shown}")
        if len(set(drafts.values())) > 1:
            shown = ", ".join(f"{s} {'yes' if v else 'no'}" for s, v in sorted(drafts.items()))
            self.disagreements.append(f"draft model loaded: {shown}; counted as not loaded")
        return self


class PlannedCap(_Record):
    """A running-request cap computed from the lane's config before boot (planned.py): the boot facts
    still decide; this says early when a lane cannot pass its own capacity gate."""

    cap: int  # an upper bound: the KV pool, known only at boot, may allow fewer
    reason: str  # how it was computed, in the engine's words
    fix: str  # what to change when it is below the bench's concurrency


class Metrics(_Record):
    """One scrape of the server's Prometheus endpoint: series name (with sorted labels) -> value."""

    values: dict[str, float] = {}

    def get(self, name: str, default: float = 0.0) -> float:
        return self.values.get(name, default)

    def total(self, name: str) -> float:
        """A counter summed over all its label sets (vLLM/SGLang label every series)."""
        if "{" in name:
            return self.values.get(name, 0.0)
        return sum(v for k, v in self.values.items() if k == name or k.startswith(name + "{"))


class Acceptance(_Record):
    """Speculative acceptance over one window, in lanebench's single definition: acceptance_length =
    1 + accepted / verification steps; per_position[k] = drafts accepted at k / steps (non-increasing)."""

    verify_steps: float
    accepted: float
    draft_tokens: float | None = None
    acceptance_length: float
    per_position: list[float]
    source: Literal["counters", "requests"]

    @classmethod
    def over(cls, steps: float, accepted: float, draft_tokens: float | None, accepted_at: list[float],
             source: Literal["counters", "requests"]) -> Acceptance:
        """The window from its counts (`accepted_at[k]`: steps that accepted position k), one definition for every engine."""
        return cls(verify_steps=steps, accepted=accepted, draft_tokens=draft_tokens, acceptance_length=1.0 + accepted / steps,
                   per_position=[a / steps for a in accepted_at], source=source)


class LoggedAcceptance(_Record):
    """The server's own acceptance lines over one window (vLLM's `SpecDecoding metrics`, summed): the
    counter row's cross-check. Acceptance length 1 + accepted / (drafted / K) is the engine's own
    1 + accepted / drafts when every draft is K wide (the draft-width gate's condition)."""

    lines: int
    accepted: int
    drafted: int
    acceptance_length: float
    per_position: list[float]  # drafts-weighted mean of the lines' per-position rates


class DraftPlan(_Record):
    """What an engine will draft for an argv, in lanebench's one K: draft tokens proposed per
    verification step (root and bonus token not counted). Engines count their own way (SGLang's
    num_draft_tokens and DFLASH block include the root); each adapter converts once, both ways
    (`speculative_flags`, `draft_plan`), and checks, plan and tables read this, not a flag."""

    method: str | None  # as the release spells it ("EAGLE3", "eagle3"); None: no speculation
    k: int | None  # None: the engine decides at boot (a checkpoint's block size, a per-model default)
    flag: str  # the flag and value that decide k, as the argv has them ("--speculative-num-steps 5")
    tree: bool = False  # drafts a tree: per-position rates then mean "accepted path at least i+1"
    shape: str = "chain"  # "chain", or the tree's width ("tree, topk 4", "tree, BFS breadth up to 10")
