"""The KL gate's lanes, one after another, and the record they leave in the run folder.

`Gate` holds what flows/kl.py needs between steps (the reference's token ids and two scorings, each
candidate's scores and outcome). Every server is torn down on every path; a candidate that refuses
(tokenizer), fails to boot or dies mid-scoring is recorded with its reason (and its scores, `partial`).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import httpx
import pandas as pd
from prefect import get_run_logger

from tasks.client import auth
from tasks.engines import Engine, engine_for
from tasks.record.manifest import KlSection
from tasks.inventory.lane_hosts import every_host
from tasks.record.run_folder import RunFolder
from tasks.hosts.lock import host_lock
from tasks.serving.live import Server
from tasks.stages.serve import served_lane
from tasks.kl.stages import LaneDied, checksum, generate, quantize, score, tokenize, tokenizer_difference
from tasks.kl.config import TOKENIZER_PROBE, KlFile, ResolvedLane
from tasks.wire.kl_probes import ForcedScore, KlStatus, KlVerdict, ScoreRecord, Scoring, Sequence
from tasks.kl.report import histogram, render
from tasks.kl.stats import bar_failures, pair_rows, position_rows, summary_row
from tasks.record.progress import progress
from tasks.client.prompts import Prompt

GATE_DIR = "gate"  # run-folder folder of the cross-lane tables, beside one folder per lane


@dataclass
class Outcome:
    status: KlStatus
    reason: str = ""
    scores: dict[str, list[ForcedScore]] = field(default_factory=dict)


class Gate:
    def __init__(self, run: RunFolder, spec: KlFile, lanes: dict[str, ResolvedLane], prompts: list[Prompt],
                 title: str) -> None:
        self.run, self.spec, self.lanes, self.prompts, self.title = run, spec, lanes, prompts, title
        self.logger = get_run_logger()
        self.sequences: list[Sequence] = []
        self.probe: list[int] = []
        self.ref: dict[str, list[ForcedScore]] = {}
        self.outcomes: dict[str, Outcome] = {}
        self.exactness: dict | None = None
        self.refusal = ""  # set when the gate cannot judge at all
        for name, rl in lanes.items():
            self.run.lane(name).config = {**rl.lane.model_dump(mode="json"),
                                          "quantize": rl.quantize.model_dump(mode="json") if rl.quantize else None,
                                          "dropped_flags": [*rl.dropped_flags]}
        self.run.save_manifest()

    # --- steps --------------------------------------------------------------------------------

    def prepare_models(self) -> None:
        """Quantize where a lane asks for it; a lane whose model cannot be made is skipped with the reason."""
        for name, rl in self.lanes.items():
            if rl.quantize is None:
                continue
            self.run.stage(name, f"quantize {rl.quantize.type}")
            try:
                assert rl.quantize_source is not None  # resolved with `quantize` (tasks/kl/config.py)
                out = quantize(rl.quantize_source, rl.quantize.type, self.run.lane_dir(name) / "quantize.log")
            except Exception as e:  # noqa: BLE001 - the reason goes to the record
                self.outcomes[name] = Outcome("skipped", f"quantize: {e}")
                continue
            model = rl.lane.model.model_copy(update={"path": str(out), "bytes": None, "sha256": None})
            self.lanes[name] = rl.model_copy(update={"lane": rl.lane.model_copy(update={"model": model})})
            self.run.lane(name).config["model"] = model.model_dump(mode="json")

    @contextmanager
    def _served(self, name: str) -> Iterator[tuple[Server, httpx.Client, Engine] | None]:
        """Serve one lane as every flow does (host lock, preflight, pull, boot, teardown); None: it cannot run."""
        rl, record = self.lanes[name], self.run.lane(name)
        with host_lock(every_host(rl.lane), on_wait=lambda m: progress(name, m)) as hold:
            record.host_lock = hold.model_copy()  # as acquired
            with served_lane(self.run, name, rl.lane, rl.host, rl.base_dir, rl.inventory, gates=False) as served:
                if served is None:
                    yield None
                    return
                # One client, closed before the server stops: no idle keep-alive is left for the server
                # to close (its TIME_WAIT would hold the port a minute against the next preflight).
                n = self.spec.concurrency + 1
                with httpx.Client(limits=httpx.Limits(max_connections=n, max_keepalive_connections=n),
                                  headers=auth.headers(served.server.base_url)) as client:
                    yield served.server, client, engine_for(rl.lane.engine)
            record.host_lock = hold.model_copy()  # as acquired

    def _keep(self, lane: str, scoring: Scoring):
        def on_prompt(prompt_id: str, scores: list[ForcedScore], seconds: float) -> None:
            self.run.append_jsonl(lane, "scores.jsonl", ScoreRecord(
                lane=lane, scoring=scoring, prompt_id=prompt_id, positions=[s.position for s in scores],
                logprobs=[s.logprob for s in scores], argmax=[s.argmax for s in scores], seconds=round(seconds, 4)))
        return on_prompt

    def reference(self) -> bool:
        """Generate on the reference and score its text twice; False when the gate cannot go on."""
        name, record = self.spec.reference, self.run.lane(self.spec.reference)
        if name in self.outcomes:  # its model could not be made
            record.status, record.reason = "skipped", self.outcomes[name].reason
            self.refusal = f"reference {name} could not run: {record.reason}"
            return False
        try:
            with self._served(name) as served:
                if served is None:
                    self.refusal = f"reference {name} could not run: {record.reason}"
                    return False
                server, client, engine = served
                self.run.stage(name, "tokenizer probe")
                self.probe = tokenize(client, server, engine, TOKENIZER_PROBE)
                self.run.stage(name, f"generate {len(self.prompts)} x {self.spec.tokens_per_prompt} tokens")
                self.sequences = generate(client, server, engine, self.prompts, self.spec.tokens_per_prompt,
                                          self.spec.ignore_eos,
                                          lambda s: self.run.append_jsonl(name, "reference.jsonl", s))
                self.run.stage(name, "score 1 (teacher-forced)")
                self.ref = score(client, server, engine, self.sequences, self.spec.concurrency, self._keep(name, "reference-1"))
                self.run.stage(name, "score 2 (exactness)")
                again = score(client, server, engine, self.sequences, self.spec.concurrency, self._keep(name, "reference-2"))
        except Exception as e:
            record.status, record.reason = "failed", f"{record.stage}: {type(e).__name__}: {e}"
            self.logger.exception("reference %s failed in %s", name, record.stage)
            self.refusal = f"reference {name} failed: {record.reason}"
            return False
        self.outcomes[name] = Outcome("complete", scores=again)
        self.exactness = _exactness(self.ref, again, self.spec.exactness_tolerance)
        if not self.exactness["exact"]:
            record.status = "failed"
            record.reason = (f"instrument not exact: scoring the reference's own text twice differs by up to "
                             f"{self.exactness['max_abs_dlogprob']:.3g} nats at {self.exactness['differing_positions']} "
                             f"positions (tolerance {self.spec.exactness_tolerance:g})")
            self.refusal = f"refused to judge: {record.reason}"
            return False
        record.status = "passed"
        return True

    def candidate(self, name: str) -> None:
        record = self.run.lane(name)
        if name in self.outcomes:
            record.status, record.reason = "skipped", self.outcomes[name].reason
            return
        try:
            with self._served(name) as served:
                if served is None:
                    self.outcomes[name] = Outcome("skipped", record.reason)
                    return
                server, client, engine = served
                self.run.stage(name, "tokenizer probe")
                diff = tokenizer_difference(self.probe, tokenize(client, server, engine, TOKENIZER_PROBE))
                if diff is not None:
                    reason = (f"refused: tokenizer differs from the reference {self.spec.reference}'s: {diff}; "
                              "teacher-forced scores compare token ids, so lanes must share one vocabulary")
                    self.outcomes[name] = Outcome("refused", reason)
                    return
                longest = max(len(s.tokens) for s in self.sequences)
                if longest > self.lanes[name].lane.context:
                    self.outcomes[name] = Outcome("failed", f"context {self.lanes[name].lane.context} per slot is shorter "
                                                            f"than the longest sequence to score ({longest} tokens)")
                    return
                self.run.stage(name, "score (teacher-forced)")
                try:
                    scores = score(client, server, engine, self.sequences, self.spec.concurrency, self._keep(name, "candidate"))
                    self.outcomes[name] = Outcome("complete", scores=scores)
                except LaneDied as e:
                    got = sum(len(s) for s in e.scores.values())
                    reason = (f"died mid-scoring ({e}) after {got} of {_expected(self.sequences)} positions; "
                              "partial results kept and marked")
                    self.outcomes[name] = Outcome("partial", reason, e.scores)
                    record.warnings.append(reason)
        except Exception as e:
            self.outcomes[name] = Outcome("failed", f"{record.stage}: {type(e).__name__}: {e}")
            self.logger.exception("candidate %s failed in %s", name, record.stage)

    # --- record ------------------------------------------------------------------------------

    def finish(self) -> tuple[bool, list[str]]:
        """Tables (validated), histogram, report.md and Prefect artifacts; returns (passed, reasons)."""
        spec, expected = self.spec, _expected(self.sequences)
        frames: dict[str, pd.DataFrame] = {}
        summary = []
        reasons = [self.refusal] if self.refusal else []
        ref_name = spec.reference
        ref_out = self.outcomes.get(ref_name)
        if ref_out is not None and ref_out.status == "complete":
            df = self._table(ref_name, position_rows(ref_name, self.sequences, self.ref, ref_out.scores))
            exact = bool(self.exactness and self.exactness["exact"])
            summary.append(summary_row(ref_name, "reference", "complete", df, expected, "exact" if exact else "inexact",
                                       "" if exact else self.run.lane(ref_name).reason))
        else:
            summary.append(summary_row(ref_name, "reference", "failed" if self.sequences else "skipped", pd.DataFrame(),
                                       expected, "no verdict", self.run.lane(ref_name).reason))
        for name in spec.candidates:
            out = self.outcomes.get(name) or Outcome("skipped", "not scored: " + (self.refusal or "the gate stopped"))
            record = self.run.lane(name)
            verdict: KlVerdict
            df = self._table(name, position_rows(name, self.sequences, self.ref, out.scores)) if out.scores else pd.DataFrame()
            if self.refusal:
                verdict, reason = "no verdict", out.reason
            elif out.status != "complete":
                verdict, reason = "fail", out.reason
            else:
                misses = bar_failures(summary_row(name, "candidate", "complete", df, expected, "pass").model_dump(), spec.bars)
                verdict, reason = ("fail", "; ".join(misses)) if misses else ("pass", "")
            summary.append(summary_row(name, "candidate", out.status, df, expected, verdict, reason))
            record.status = "passed" if verdict == "pass" else ("skipped" if out.status == "skipped" else "failed")
            record.reason = reason
            if verdict != "pass" and not self.refusal:
                reasons.append(f"{name}: {reason}")
            if not df.empty:
                frames[name] = df
        self.run.lane_dir(GATE_DIR)
        summary_df = self.run.write_table(GATE_DIR, "kl_summary", summary)[0]
        pairs = pair_rows(frames, spec.bootstrap_resamples, spec.seed)
        pairs_df = self.run.write_table(GATE_DIR, "kl_pairs", pairs)[0] if pairs else pd.DataFrame()
        if failed_tables := {e.path for e in self.run.manifest.artifacts
                             if e.kind in ("kl_summary", "kl_pairs", "kl_positions") and e.validation == "failed"}:
            reasons.append("expectations failed for " + ", ".join(sorted(failed_tables)) + "; quarantined")
        plot = f"{GATE_DIR}/kl_hist.png" if histogram(frames, self.run.path / GATE_DIR / "kl_hist.png") else None
        if plot:
            self.run.register(GATE_DIR, plot, "plot")
        for name in self.lanes:
            for raw, kind in (("reference.jsonl", "kl-reference"), ("scores.jsonl", "kl-scores")):
                if (self.run.path / name / raw).exists():
                    self.run.register(name, f"{name}/{raw}", kind)
        passed = not reasons
        headline = "PASS" if passed else ("NO VERDICT" if self.refusal else "FAIL")
        flags = self._flags()
        # The headline states what the verdict rests on: positions scored against those asked, and
        # a reference that is not what it claims (kl/suspicious.py).
        short = [f"{r.lane} {r.positions}/{r.positions_expected} positions scored"
                 for r in summary if r.positions < r.positions_expected]
        asked = len(self.prompts) * self.spec.tokens_per_prompt  # a reference that stopped early scored fewer
        if self.sequences and _expected(self.sequences) < asked:
            short.insert(0, f"{self.spec.reference} generated {_expected(self.sequences)}/{asked} positions asked")
        suffix = (f" (ONLY {'; '.join(short)})" if short else "") + \
            (f", FLAGGED: {'; '.join(f.split(':')[0] for f in flags)}" if flags else "")
        report = render(self.title, self._facts(headline + suffix, flags), summary_df, pairs_df, headline, reasons, plot)
        report = report.replace(f"**{headline}**", f"**{headline}**{suffix}", 1)
        report += "".join(f"\n- **FLAG** {f}" for f in flags) + ("\n" if flags else "")
        (self.run.path / "report.md").write_text(report)
        self.run.register("", "report.md", "report")
        _publish(summary_df, pairs_df, report, self.run.path.name)
        return passed, reasons

    def _flags(self) -> list[str]:
        """A quantized or short-context reference, a candidate with the reference's bytes (kl/suspicious.py)."""
        from tasks.kl.suspicious import kl_flags

        lanes = {}
        for name, rl in self.lanes.items():
            record = self.run.lane(name)
            model = next((m for m in record.models if m.role == "model"), None)
            lanes[name] = {"path": rl.lane.model.path, "sha256": model.sha256 if model else None,
                           "quantize": rl.quantize.type if rl.quantize else None,
                           "context": record.boot_facts.get("context_per_slot") or rl.lane.context,
                           "flags": list(rl.lane.flags)}
        flags = kl_flags(self.spec.reference, lanes)
        for flag in flags:
            self.logger.warning(flag)
            progress("kl", f"FLAG: {flag}")
        return flags

    def _table(self, lane: str, rows: list) -> pd.DataFrame:
        return self.run.write_table(lane, "kl_positions", rows)[0] if rows else pd.DataFrame()

    def _facts(self, headline: str, flags: list[str]) -> dict:
        spec = self.spec
        with self.run.edit() as m:
            m.flow.kl = facts = KlSection(
                reference=spec.reference, candidates=spec.candidates, prompts=len(self.prompts),
                prompt_count_in_file=spec.prompt_count, tokens_per_prompt=spec.tokens_per_prompt,
                positions=_expected(self.sequences), text_sha256=checksum(self.sequences),
                probe_tokens=len(self.probe), ignore_eos=spec.ignore_eos, concurrency=spec.concurrency,
                resamples=spec.bootstrap_resamples, seed=spec.seed, tolerance=spec.exactness_tolerance,
                bars=spec.bars.model_dump(mode="json"), exactness=self.exactness, headline=headline, flags=flags)
        return facts.model_dump(exclude={"headline", "flags"})


def _expected(sequences: list[Sequence]) -> int:
    return sum(len(s.continuation) for s in sequences)


def _exactness(first: dict[str, list[ForcedScore]], second: dict[str, list[ForcedScore]], tol: float) -> dict:
    """Two scorings of the same text on the same server, position by position."""
    pairs = [(x, y) for pid, a in first.items() for x, y in zip(a, second.get(pid, []))]
    diffs = [abs(x.logprob - y.logprob) for x, y in pairs]
    argmax_differs, worst = sum(x.argmax != y.argmax for x, y in pairs), max(diffs, default=0.0)
    return {"positions": len(pairs), "max_abs_dlogprob": worst, "differing_positions": sum(d > 0 for d in diffs),
            "argmax_differs": argmax_differs, "tolerance": tol, "exact": worst <= tol and argmax_differs == 0}


def _publish(summary: pd.DataFrame, pairs: pd.DataFrame, report: str, run_name: str) -> None:
    """The tables and the report as Prefect artifacts, for the UI."""
    from prefect.artifacts import create_markdown_artifact, create_table_artifact

    if not summary.empty:
        create_table_artifact(key="kl-summary", table=summary.round(5).to_dict(orient="records"),
                              description=f"KL gate per lane ({run_name})")
    if not pairs.empty:
        create_table_artifact(key="kl-pairs", table=pairs.round(5).to_dict(orient="records"),
                              description=f"KL gate between candidates ({run_name})")
    create_markdown_artifact(key="kl-report", markdown=report, description=run_name)
