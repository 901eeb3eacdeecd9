"""KL gate stages (the seeds' instrument): quantize, tokenizer probe, the reference's greedy tokens, and
every lane scoring exactly those ids teacher-forced, through `Engine` adapters only. Scoring keeps
what it has when a server dies (`LaneDied` carries it), each prompt's scores handed to `on_prompt`."""

from __future__ import annotations

import hashlib
import os
import subprocess
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
from prefect import task
from prefect.cache_policies import NO_CACHE

from tasks.serving.live import Server
from tasks.engines.build import llama_cpp_bin_dir
from tasks.engines import Engine
from tasks.hosts.files import sha256_of
from tasks.inventory.paths import CACHE
from tasks.wire.kl_probes import ForcedProbe, ForcedScore, ProbeRetry, Sequence
from tasks.client.prompts import Prompt
from tasks.wire.records import RequestSpec

REQUEST_TIMEOUT_S = 120.0
QUANTIZE_TIMEOUT_S = 1800.0


class LaneDied(RuntimeError):
    """The server stopped answering mid-stage; `scores` holds what was scored before."""

    def __init__(self, message: str, scores: dict[str, list[ForcedScore]] | None = None) -> None:
        super().__init__(message)
        self.scores = scores or {}


class KlRequestError(RuntimeError):
    """The server answered, but not with what the stage asked for (HTTP error, bad shape)."""


def quantized_path(source: Path, qtype: str) -> Path:
    """Cache location of a quantized GGUF, keyed by the source's sha256 so a new source never reuses it."""
    return CACHE / "quant" / f"{sha256_of(source)[:16]}-{qtype}.gguf"


@task(name="quantize", cache_policy=NO_CACHE)
def quantize(source: Path, qtype: str, log_path: Path) -> Path:
    """llama-quantize `source` to `qtype` once; later runs reuse the cached file."""
    out = quantized_path(source, qtype)
    if out.is_file():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(f".tmp{os.getpid()}")
    binary = llama_cpp_bin_dir() / "llama-quantize"
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with log_path.open("ab") as log:
        proc = subprocess.run([str(binary), str(source), str(tmp), qtype], check=False, stdout=log, stderr=subprocess.STDOUT,
                              timeout=QUANTIZE_TIMEOUT_S)
    if proc.returncode != 0 or not tmp.is_file():
        tmp.unlink(missing_ok=True)
        raise RuntimeError(f"llama-quantize {qtype} of {source} failed (exit {proc.returncode}); see {log_path}")
    tmp.replace(out)
    return out


def _post(client: httpx.Client, server: Server, spec: RequestSpec | ForcedProbe) -> dict:
    """POST one request; a dead or unreachable server is LaneDied, any other failure KlRequestError."""
    try:
        r = client.post(server.base_url + spec.path, json=spec.body, timeout=REQUEST_TIMEOUT_S)
    except httpx.TransportError as e:
        code = server.process.poll()
        state = ("server stopped answering" if code is None else
                 f"server killed by signal {-code}" if code < 0 else f"server exited with code {code}")
        raise LaneDied(f"{state} ({type(e).__name__})") from e
    if r.status_code >= 500 and (code := server.process.poll()) is not None:
        raise LaneDied(f"server exited with code {code} (HTTP {r.status_code})")
    if r.status_code != 200:
        raise KlRequestError(f"{spec.path} answered HTTP {r.status_code}: {r.text[:300]}")
    return r.json()


def tokenize(client: httpx.Client, server: Server, engine: Engine, text: str) -> list[int]:
    return engine.parse_tokenize(_post(client, server, engine.tokenize_request(text)))


def tokenizer_difference(reference: list[int], other: list[int]) -> str | None:
    """None when both tokenizations agree; else where they first differ, in words."""
    if reference == other:
        return None
    i = next((j for j, (a, b) in enumerate(zip(reference, other)) if a != b), min(len(reference), len(other)))
    return (f"the probe text tokenizes to {len(other)} tokens instead of {len(reference)}, first difference at "
            f"token {i} ({other[i] if i < len(other) else 'end'} instead of {reference[i] if i < len(reference) else 'end'})")


def generate(client: httpx.Client, server: Server, engine: Engine, prompts: list[Prompt], max_tokens: int,
             ignore_eos: bool, on_sequence: Callable[[Sequence], None]) -> list[Sequence]:
    """The reference's greedy continuation of every prompt, as token ids (prompt tokenized by the reference)."""
    out = []
    for p in prompts:
        context = tokenize(client, server, engine, p.text)
        continuation = engine.parse_greedy_tokens(
            _post(client, server, engine.greedy_tokens_request(context, max_tokens, ignore_eos)))
        if not continuation:
            raise KlRequestError(f"prompt {p.id}: the reference generated no token")
        seq = Sequence(prompt_id=p.id, context=context, continuation=continuation, text=p.text)
        on_sequence(seq)
        out.append(seq)
    return out


def _score_one(client: httpx.Client, server: Server, engine: Engine, seq: Sequence) -> list[ForcedScore]:
    """Teacher-forced scores of the continuation positions of one sequence, position 0 = first generated token."""
    start = len(seq.context)
    scores: list[ForcedScore] = []
    try:
        for probe in engine.forced_probes(seq.tokens, start):
            data = _post(client, server, probe)
            try:
                got = engine.parse_forced(probe, data)
            except ProbeRetry as retry:
                got = engine.parse_forced(retry.probe, _post(client, server, retry.probe))
            scores += [s.model_copy(update={"position": s.position - start}) for s in got]
    except LaneDied as e:
        e.scores = {seq.prompt_id: scores}
        raise
    return scores


def score(client: httpx.Client, server: Server, engine: Engine, sequences: list[Sequence], concurrency: int,
          on_prompt: Callable[[str, list[ForcedScore], float], None]) -> dict[str, list[ForcedScore]]:
    """Score every sequence teacher-forced, `concurrency` prompts at a time (one shared client); raises
    LaneDied with every score obtained (finished prompts and the dying ones' prefix)."""
    done: dict[str, list[ForcedScore]] = {}
    died: list[LaneDied] = []

    def job(seq: Sequence) -> None:
        if died:
            return
        t0 = time.monotonic()
        try:
            got = _score_one(client, server, engine, seq)
        except LaneDied as e:
            died.append(e)
            return
        done[seq.prompt_id] = got
        on_prompt(seq.prompt_id, got, time.monotonic() - t0)

    if concurrency == 1:  # in order: a failing prompt stops the scoring at once
        for seq in sequences:
            job(seq)
            if died:
                break
    else:
        with ThreadPoolExecutor(concurrency) as pool:
            for f in [pool.submit(job, s) for s in sequences]:
                f.result()
    if died:
        partial = dict(done)
        for e in died:
            for pid, s in e.scores.items():
                if s:
                    partial[pid] = s
                    on_prompt(pid, s, 0.0)
        raise LaneDied(str(died[0]), partial)
    return done


def checksum(sequences: list[Sequence]) -> str:
    """One hash of the token ids every lane scored: the report states which text was measured."""
    h = hashlib.sha256()
    for s in sequences:
        h.update(f"{s.prompt_id}:{s.context}:{s.continuation}\n".encode())
    return h.hexdigest()
