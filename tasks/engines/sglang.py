"""SGLang (`python3 -m sglang.launch_server`): lanes with DFlash/EAGLE drafters on hybrid models.

Facts read from sgl-project/sglang (paths under python/sglang/srt/):
- The resolved running-request cap is only in the log (the mamba state cache's and the scheduler's
  lines, sglang_boot.py; the smallest wins per data-parallel replica); `server_args=...` echoes
  what was *asked*: only the algorithm and draft path are read from it.
- /metrics has only interval gauges for speculation plus `sglang:spec_verify_calls_total`
  (PR #25689): no accepted-token counter, so acceptance comes from the requests' `meta_info`
  (managers/tokenizer_manager_components/spec_decoding_meta.py): `spec_verify_ct`,
  `spec_num_correct_drafts` (bonus excluded), `spec_num_proposed_drafts`,
  `spec_correct_drafts_histogram` (hist[j] = verify steps that accepted exactly j drafts,
  managers/schedule_batch.py); older names `spec_accepted_drafts`/`spec_proposed_drafts`/
  `spec_accept_histogram`, before those `spec_accept_token_num`/`spec_draft_token_num` (PR #13754).
- Native /generate streams cumulative `text`/`output_ids` unless launched with
  `--incremental-streaming-output` (older: `--stream-output`; tokenizer_manager.py): adapters are
  shared across requests, so we launch with it rather than keep per-request state.
- `/server_info` (`/get_server_info` on older builds) is read where the log is silent (sglang_boot.py).
- `extra_key` (managers/io_struct.py, "e.g. cache_salt") namespaces the radix cache: a fresh key
  per request means no prefix reuse.

K (draft tokens per verification step) converts both ways in `speculative_flags` / `sglang_draft_plan`:
num_draft_tokens and the DFLASH block count the verified root (DFLASH forces steps=1, topk=1); DSPARK's
block is K (proposed = verify_ct x block, block+1 histogram buckets: PR #33518).

`binary` is the Python interpreter of the environment with sglang (SGLang has no entry point).
"""

from __future__ import annotations

import uuid
from typing import Any

import msgspec

from tasks.inventory.models import Agentic, Lane
from tasks.engines.base import Engine, parser_flags
from tasks.wire.kl_probes import ForcedProbe, ForcedScore
from tasks.wire.records import RequestRecord, RequestSpec, StreamEvent
from tasks.engines.facts import Acceptance, BootFacts, DraftPlan, Metrics, PlannedCap
from tasks.engines import planned, sglang_boot

_CHAIN = {"EAGLE", "EAGLE3", "NEXTN", "STANDALONE", "FROZEN_KV_MTP"}
_ALIASES = {"SIMPLE": "STANDALONE", "DRAFT_MODEL": "STANDALONE", "MTP": "NEXTN"}
# NEXTN is a reserved alias of EAGLE, names upper-cased (srt/speculative/spec_info.py `from_string`).
_SAME = {"NEXTN": "EAGLE"}
_NGRAM_DRAFT_TOKENS, _NGRAM_BFS_BREADTH = 12, 10  # srt/arg_groups: _handle_ngram, fields/spec.py defaults

# Per-request speculation fields, canonical name first, then older releases' names.
_CORRECT = ("spec_num_correct_drafts", "spec_accepted_drafts", "spec_accept_token_num")
_PROPOSED = ("spec_num_proposed_drafts", "spec_proposed_drafts", "spec_draft_token_num")
_HIST = ("spec_correct_drafts_histogram", "spec_accept_histogram")


class _TokenMeta(msgspec.Struct):
    finish_reason: Any = None


class _TokenChunk(msgspec.Struct):
    """What SGLang.token_event reads of a /generate stream chunk (Engine.token_chunk)."""
    text: Any = ""
    output_ids: Any = None
    meta_info: _TokenMeta | None = None
    error: Any = msgspec.UNSET  # present at all: an error body


def sglang_method(method: str) -> str:
    """Lane method name -> SGLang's `--speculative-algorithm` value ("draft-eagle3" -> "EAGLE3")."""
    name = method.upper().replace("-", "_").removeprefix("DRAFT_")
    return _ALIASES.get(name, name)


def _int_flag(argv: list[str], name: str) -> tuple[int | None, str]:
    value = planned.flag_value(argv, name)
    return (int(value) if value is not None and value.lstrip("-").isdigit() else None), f"{name} {value}"


def sglang_draft_plan(argv: list[str]) -> DraftPlan | None:
    """K as SGLang 0.5.23 will run an argv (`srt/arg_groups/speculative_hook.py`), which is exactly
    `spec_num_proposed_drafts / verify_ct`:
    - EAGLE family: topk 1 drafts `--speculative-num-steps` N (num_draft_tokens re-resolved to N+1);
      topk > 1 verifies a tree `--speculative-num-draft-tokens` wide, root included: K = that - 1.
      No steps: SGLang picks all three per model.
    - DFLASH: the block (`--speculative-dflash-block-size`, alias of num_draft_tokens) holds the
      anchor: K = block - 1 (`srt/speculative/dflash_worker_v2.py`); none: the checkpoint's.
    - DSPARK: `--speculative-dspark-block-size` is gamma = K (verify window gamma + 1).
    - NGRAM: K = num_draft_tokens - 1 (default 12), a BFS tree up to
      `--speculative-ngram-max-bfs-breadth` wide (default 10)."""
    algo = planned.flag_value(argv, "--speculative-algorithm")
    if algo is None:
        return None
    name = algo.upper()
    if name in _CHAIN:
        steps, steps_flag = _int_flag(argv, "--speculative-num-steps")
        topk, topk_flag = _int_flag(argv, "--speculative-eagle-topk")
        if steps is None:
            return DraftPlan(method=algo, k=None, flag="--speculative-num-steps (unset: SGLang picks it per model)")
        adaptive = "--speculative-adaptive" in argv  # fields/spec.py: num_steps follows the acceptance rate
        if topk is None or topk <= 1:
            return DraftPlan(method=algo, k=steps, flag=steps_flag,
                             shape="chain, adaptive: SGLang moves num_steps with acceptance" if adaptive else "chain")
        width, width_flag = _int_flag(argv, "--speculative-num-draft-tokens")
        return DraftPlan(method=algo, k=None if width is None else width - 1, tree=True, shape=f"tree, topk {topk}",
                         flag=width_flag if width is not None else f"{topk_flag} (num_draft_tokens unset)")
    if name in ("DFLASH", "DSPARK"):
        own = f"--speculative-{name.lower()}-block-size"
        width, flag = _int_flag(argv, own)
        if width is not None and name == "DSPARK":  # gamma: the block without the anchor DFLASH's holds
            width += 1
        if width is None:
            width, flag = _int_flag(argv, "--speculative-num-draft-tokens")
        return DraftPlan(method=algo, k=None if width is None else width - 1,
                         flag=flag if width is not None else f"{own} (unset: the checkpoint's)")
    if name == "NGRAM":
        width, flag = _int_flag(argv, "--speculative-num-draft-tokens")
        breadth, _ = _int_flag(argv, "--speculative-ngram-max-bfs-breadth")
        breadth = _NGRAM_BFS_BREADTH if breadth is None else breadth
        if width is None:
            width, flag = _NGRAM_DRAFT_TOKENS, f"--speculative-num-draft-tokens (unset: {_NGRAM_DRAFT_TOKENS})"
        return DraftPlan(method=algo, k=width - 1, flag=flag, tree=breadth > 1,
                         shape=f"tree, BFS breadth up to {breadth}" if breadth > 1 else "chain")
    return DraftPlan(method=algo, k=None, flag=f"--speculative-algorithm {algo} (a width lanebench cannot read)")


def _first(meta: dict, names: tuple[str, ...]) -> Any:
    return next((meta[n] for n in names if meta.get(n) is not None), None)


def _num(spec: dict[str, float | list[float]], key: str) -> float:
    value = spec.get(key, 0.0)
    return float(value) if not isinstance(value, list) else 0.0


class SGLang(Engine):
    name = "sglang"
    draft_counter = "sglang:spec_verify_calls_total"  # srt/observability/metrics_collector.py
    queue_gauge = "sglang:num_queue_reqs"
    token_chunk = _TokenChunk
    info_path = "/server_info"  # /get_server_info before it was renamed

    def launch_command(self, lane: Lane, binary: str, host: str) -> list[str]:
        argv = [binary, "-m", "sglang.launch_server", "--model-path", lane.model.path, "--host", host,
                "--port", str(lane.port), "--context-length", str(lane.context), "--enable-metrics",
                "--incremental-streaming-output"]
        # No --max-running-requests from lane.slots: SGLang resolves and logs its own cap (memory,
        # mamba state), which the capacity gate reads; a lower ceiling goes in lane.flags.
        if lane.speculative is not None:
            argv += self.speculative_flags(lane.speculative.method, lane.speculative.k,
                                           lane.drafter.path if lane.drafter else None)
        return argv + list(lane.flags)

    method_name = staticmethod(sglang_method)

    def speculative_flags(self, method: str, k: int, drafter: str | None) -> list[str]:
        """K -> SGLang's flags, the inverse of `sglang_draft_plan` (module docstring: which include the root)."""
        algo = sglang_method(method)
        flags = ["--speculative-algorithm", algo]
        if drafter is not None:
            flags += ["--speculative-draft-model-path", drafter]
        if algo in _CHAIN:
            flags += ["--speculative-num-steps", str(k), "--speculative-eagle-topk", "1",
                      "--speculative-num-draft-tokens", str(k + 1)]
        elif algo == "DFLASH":
            flags += ["--speculative-dflash-block-size", str(k + 1)]
        elif algo == "DSPARK":
            flags += ["--speculative-dspark-block-size", str(k)]
        elif algo == "NGRAM":
            flags += ["--speculative-num-draft-tokens", str(k + 1)]
        return flags

    draft_plan = staticmethod(sglang_draft_plan)

    def same_method(self, given: str, declared: str) -> bool:
        a, b = given.upper(), sglang_method(declared).upper()
        return _SAME.get(a, a) == _SAME.get(b, b)

    # --- Draft counts for the implied gates: the proposed count is only in each request's meta_info ---

    def draft_window(self, before: Metrics, after: Metrics, requests: list[RequestRecord]) -> tuple[float, float] | None:
        specs = [r.spec for r in requests if r.spec and "spec_num_proposed_drafts" in r.spec]
        if not specs:
            return None
        return (sum(_num(s, "spec_verify_ct") for s in specs), sum(_num(s, "spec_num_proposed_drafts") for s in specs))

    def effective_k_of(self, requests: list[RequestRecord]) -> int | None:
        """Proposed drafts per verify step of the probe requests: the server's resolved K, exactly."""
        window = self.draft_window(Metrics(), Metrics(), requests)
        per_step = window[1] / window[0] if window is not None and window[0] > 0 else None
        return int(per_step) if per_step is not None and per_step == int(per_step) else None

    boot_facts = staticmethod(sglang_boot.boot_facts)  # per release: server args, per-worker caps x DP workers

    def info_facts(self, facts: BootFacts, info: dict | list) -> BootFacts:
        """/server_info's cap, speculation type and version beside the log's (the lowest cap wins)."""
        return sglang_boot.info_facts(facts, info) if isinstance(info, dict) else facts

    def planned_cap(self, lane: Lane) -> PlannedCap | None:
        """0.5.23 (`srt/mem_cache/kv_cache_configurator.py` `_calculate_mamba_ratio`): per worker,
        `max_mamba_cache_size // ratio` and `--max-running-requests // attn_dp_size`; ratio = 3 state slots
        per request plus the radix cache's extra buffer (2 with the overlap scheduler, 1 without or lazy,
        `srt/mem_cache/allocation_sizing.py`), or 1 with `--disable-radix-cache`. 'auto' resolves per
        model; we take the extra buffer (5, as the GLM field logs print), its lowest cap. Workers =
        dp_size x attn_dp_size."""
        argv = self.launch_command(lane, "python3", "0.0.0.0")
        dp = planned.int_flag(argv, "--dp-size", "--data-parallel-size") or 1
        attn_dp = planned.int_flag(argv, "--attn-dp-size", "--attention-data-parallel-size") or 1
        if "--enable-dp-attention" in argv:  # deprecated spelling: --dp-size N means N attention-DP workers
            dp, attn_dp = 1, dp
        workers = dp * attn_dp
        per_worker_wanted = -(-max(lane.bench.decode.gated_levels()) // workers)
        caps: list[tuple[int, str, str]] = []
        if (cache := planned.int_flag(argv, "--max-mamba-cache-size")) is not None:
            strategy = planned.flag_value(argv, "--mamba-radix-cache-strategy") or "auto"
            if "--disable-radix-cache" in argv:
                ratio, why = 1, "--disable-radix-cache"
            elif strategy == "no_buffer":
                ratio, why = 3, "strategy no_buffer"
            elif strategy == "extra_buffer_lazy" or "--disable-overlap-schedule" in argv:
                ratio, why = 4, f"strategy {strategy}, extra buffer of 1"
            else:
                ratio, why = 5, f"strategy {strategy}: extra buffer with the overlap scheduler"
            caps.append((cache // ratio, f"--max-mamba-cache-size {cache} // {ratio} state slots per request ({why})",
                         f"raise --max-mamba-cache-size to at least {per_worker_wanted * ratio}"))
        if (asked := planned.int_flag(argv, "--max-running-requests")) is not None:
            split = f" // {attn_dp} attention-DP workers" if attn_dp > 1 else ""
            caps.append((max(1, asked // attn_dp), f"--max-running-requests {asked}{split}",
                         f"raise --max-running-requests to at least {per_worker_wanted * attn_dp}"))
        if not caps:
            return None
        per_worker, reason, fix = min(caps)
        shape = f" x {workers} data-parallel workers" if workers > 1 else ""
        return PlannedCap(cap=per_worker * workers, reason=f"{reason}{shape}", fix=fix)

    def node_flags(self, rank: int, nnodes: int, master: str, port: int) -> list[str]:
        # srt/arg_groups/fields/parallel.py: --nnodes, --node-rank, --dist-init-addr HOST:PORT.
        address = f"[{master}]:{port}" if ":" in master else f"{master}:{port}"
        return ["--nnodes", str(nnodes), "--node-rank", str(rank), "--dist-init-addr", address]

    def acceptance(self, before: Metrics, after: Metrics, requests: list[RequestRecord], k: int) -> Acceptance | None:
        # /metrics has no accepted-draft counter (module docstring): sum the requests' own counts.
        specs = [r.spec for r in requests
                 if r.spec and _num(r.spec, "spec_verify_ct") > 0 and "spec_num_correct_drafts" in r.spec]
        if not specs:
            return None
        steps = sum(_num(s, "spec_verify_ct") for s in specs)
        accepted = sum(_num(s, "spec_num_correct_drafts") for s in specs)
        hists = [h for s in specs if isinstance(h := s.get("spec_correct_drafts_histogram"), list)]
        # Draft position i (0-based) was accepted in every step that kept more than i drafts.
        accepted_at = [sum(sum(h[i + 1 :]) for h in hists) for i in range(k)] if len(hists) == len(specs) else []
        proposed = sum(_num(s, "spec_num_proposed_drafts") for s in specs) \
            if all("spec_num_proposed_drafts" in s for s in specs) else None
        return Acceptance.over(steps, accepted, proposed, accepted_at, "requests")

    def completion_request(self, prompt: str, max_tokens: int) -> RequestSpec:
        # Native /generate, not /v1/completions: only it returns meta_info with the spec fields.
        return RequestSpec(path="/generate", body={
            "text": prompt, "sampling_params": {"temperature": 0.0, "max_new_tokens": max_tokens}, "stream": True,
            "extra_key": uuid.uuid4().hex})

    def token_event(self, chunk: _TokenChunk) -> tuple[str, int] | None:
        meta, text = chunk.meta_info, chunk.text
        if chunk.error is not msgspec.UNSET or (meta is not None and meta.finish_reason is not None) \
                or type(text) is not str:
            return None
        return text, len(chunk.output_ids or [])

    def parse_event(self, data: dict) -> StreamEvent:
        if "error" in data:
            return StreamEvent(done=True, finish_reason="error")
        meta = data.get("meta_info") or {}
        text, tokens = data.get("text", ""), len(data.get("output_ids") or [])
        finish = meta.get("finish_reason")
        if finish is None:
            return StreamEvent(text=text, tokens=tokens)
        # {"type": "length"|"stop"|"abort", ...}: the type is already lanebench's word.
        kind = finish.get("type") if isinstance(finish, dict) else str(finish)
        return StreamEvent(text=text, tokens=tokens, done=True, completion_tokens=meta.get("completion_tokens"),
                           prompt_tokens=meta.get("prompt_tokens"), finish_reason=kind, spec=_spec_fields(meta))

    # Tool calls need `--tool-call-parser`, `reasoning_content` needs `--reasoning-parser` (the
    # seeds' GLM lane: glm47 and glm45); without them plain chat works and agents break silently.

    def agentic_flags(self, agentic: Agentic, chat_template: str | None) -> list[str]:
        return parser_flags(agentic, chat_template)

    # --- Teacher-forced scoring (KL gate): one /generate request per sequence ---------------
    # `return_logprob` + `logprob_start_len: 0` return `meta_info.input_token_logprobs`, one
    # `[logprob, token_id, text|null]` per input token (null logprob at 0); `top_logprobs_num: 1`
    # adds `input_top_logprobs`, per position `[[logprob, id, text|null], ...]` best first;
    # `max_new_tokens: 0` generates nothing (managers/tokenizer_manager.py
    # `detokenize_logprob_tokens`; slime/miles reward models send this body). Input logprobs from
    # 0 bypass the radix cache; a fresh `extra_key` makes that explicit.

    def greedy_tokens_request(self, tokens: list[int], max_tokens: int, ignore_eos: bool) -> RequestSpec:
        return RequestSpec(path="/generate", body={
            "input_ids": tokens, "sampling_params": {"temperature": 0.0, "max_new_tokens": max_tokens, "ignore_eos": ignore_eos},
            "stream": False, "extra_key": uuid.uuid4().hex})

    def parse_greedy_tokens(self, data: dict) -> list[int]:
        return [int(t) for t in data["output_ids"]]

    def forced_probes(self, tokens: list[int], start: int) -> list[ForcedProbe]:
        if start < 1:
            raise ValueError("position 0 has no prefix to be scored from")
        body = {"input_ids": tokens, "sampling_params": {"temperature": 0.0, "max_new_tokens": 0}, "return_logprob": True,
                "logprob_start_len": 0, "top_logprobs_num": 1, "stream": False, "extra_key": uuid.uuid4().hex}
        return [ForcedProbe(path="/generate", body=body, positions=list(range(start, len(tokens))), forced=tokens[start:])]

    def parse_forced(self, probe: ForcedProbe, data: dict) -> list[ForcedScore]:
        meta = data["meta_info"]
        chosen, top = meta["input_token_logprobs"], meta["input_top_logprobs"]
        n = len(probe.body["input_ids"])
        if len(chosen) != n or len(top) != n:
            raise ValueError(f"SGLang returned {len(chosen)} input logprobs for {n} input tokens")
        scores = []
        for position, forced in zip(probe.positions, probe.forced):
            logprob, token_id = chosen[position][0], chosen[position][1]
            if token_id != forced or logprob is None or not top[position]:
                raise ValueError(f"SGLang input logprob at position {position} is {chosen[position]!r}, "
                                 f"expected token {forced}")
            scores.append(ForcedScore(position=position, logprob=float(logprob), argmax=int(top[position][0][1])))
        return scores

def _spec_fields(meta: dict) -> dict[str, float | list[float]] | None:
    """The final chunk's cumulative speculation counts, under the current field names."""
    if meta.get("spec_verify_ct") is None:
        return None
    spec: dict[str, float | list[float]] = {"spec_verify_ct": float(meta["spec_verify_ct"])}
    hist = _first(meta, _HIST)
    hist = [float(x) for x in hist] if isinstance(hist, list) else None
    correct = _first(meta, _CORRECT)
    if correct is None and hist is not None:
        correct = sum(j * x for j, x in enumerate(hist))
    for key, value in (("spec_correct_drafts_histogram", hist), ("spec_num_correct_drafts", correct),
                       ("spec_num_proposed_drafts", _first(meta, _PROPOSED))):
        if value is not None:
            spec[key] = value if isinstance(value, list) else float(value)
    return spec
