"""llama.cpp's `llama-server`: the rehearsal engine, and a real engine for GGUF lanes.

Read from the tree vendored in llama-cpp-python 0.3.36 (tools/server/server-task.cpp, server-context.cpp):
speculation needs BOTH `--model-draft` and `--spec-type` (with only the first the drafter loads and
nothing is drafted: the counter gate exists for this); `-c` is the total context over `-np` slots;
`llamacpp:spec_decode_num_accepted_tokens_per_pos_total{position="k"}` counts, per verification step,
whether position k was accepted (so it never rises with k).
"""

from __future__ import annotations

import re

from tasks.inventory.models import Agentic, Lane
from tasks.engines.base import Engine
from tasks.engines.build import llama_cpp_bin_dir, llama_cpp_identity
from tasks.wire.kl_probes import ForcedProbe, ForcedScore, ProbeRetry
from tasks.wire.records import RequestRecord, RequestSpec, StreamEvent
from tasks.engines.facts import Acceptance, BootFacts, Metrics

_SLOTS = re.compile(r"initializing, n_slots = (\d+), n_ctx_slot = (\d+)")
_DRAFT_LOADED = re.compile(r"loading draft model '([^']*)'")
_SPEC_IMPL = re.compile(r"adding speculative implementation '([^']+)'")
_SPEC_TYPE = re.compile(r"speculative decoding.*type[ =:]+'?([a-z0-9-]+)")
# llama-model.cpp `load_tensors`, per model (target, then drafter), by a CUDA build at `-lv 4` only
# (otherwise the manifest has the server's GPU memory from nvidia-smi).
_OFFLOADED = re.compile(r"offloaded (\d+)/(\d+) layers to GPU")
_GPU_BUFFER = re.compile(r"(CUDA\d+) model buffer size =\s*([0-9.]+) MiB")
_GPU_DEVICE = re.compile(r"using device (CUDA\d+) \(([^)]+)\)")
# Every spelling of the offload flags in common/arg.cpp of the pinned tree.
_NGL = {"-ngl", "--gpu-layers", "--n-gpu-layers"}
_NGLD = {"-ngld", "--spec-draft-ngl", "--gpu-layers-draft", "--n-gpu-layers-draft"}

_P = "llamacpp:"
_SYNTHETIC = re.compile(r"synthetic speculative acceptance is enabled[^\n]*")
_POSITION = re.compile(r'^llamacpp:spec_decode_num_accepted_tokens_per_pos_total\{position="(\d+)"\}$')


class LlamaCpp(Engine):
    name = "llamacpp"
    pinned_build = True
    loads_model_folder = False
    model_magic = b"GGUF"
    serves_quantized_gguf = True
    slots_flags = ("--parallel", "-np")
    info_path = "/slots"
    queue_gauge = "llamacpp:requests_deferred"
    local_binary_name = "llama-server"
    draft_counter = _P + "spec_decode_num_drafts_total"
    draft_tokens_counter = _P + "spec_decode_num_draft_tokens_total"

    def effective_k(self, metrics: Metrics) -> int | None:
        """One per-position series per draft position (sized to `common_speculative_n_max`): their count is K."""
        positions = [int(m[1]) for key in metrics.values if (m := _POSITION.match(key))]
        return max(positions) + 1 if positions else None

    def invalid_speculation(self, log: str) -> str | None:
        """`--spec-synth-len` / `--spec-synth-rates` accept drafts at random (common/speculative.cpp)."""
        m = _SYNTHETIC.search(log)
        return m[0].strip() if m else None

    def local_build(self) -> tuple[str, dict[str, str]]:
        """The pinned llama.cpp build (scripts/build-llama-cpp.sh; built on first use)."""
        bin_dir = llama_cpp_bin_dir()
        return str(bin_dir / "llama-server"), llama_cpp_identity(bin_dir)

    def launch_command(self, lane: Lane, binary: str, host: str) -> list[str]:
        argv = [binary, "--model", lane.model.path, "--host", host, "--port", str(lane.port), "--parallel", str(lane.slots),
                "--ctx-size", str(lane.context * lane.slots), "--metrics", "--no-webui"]
        if lane.threads:
            argv += ["--threads", str(lane.threads), "--threads-batch", str(lane.threads)]
        if lane.drafter is not None:
            argv += ["--model-draft", lane.drafter.path]
            if lane.threads:
                argv += ["--threads-draft", str(lane.threads)]
        if lane.speculative is not None:
            argv += ["--spec-type", lane.speculative.method, "--spec-draft-n-max", str(lane.speculative.k)]
        return argv + list(lane.flags)

    def offload_flags(self, gpus: int, has_drafter: bool, lane_flags: list[str]) -> list[str]:
        """`gpus: 0` keeps every layer on the CPU (a CUDA build would offload them all), a GPU host offloads
        all of target and drafter ('all' in this pin's arg.cpp); a lane's own spelling wins."""
        layers = "all" if gpus > 0 else "0"
        flags = [] if _NGL & set(lane_flags) else ["--n-gpu-layers", layers]
        if has_drafter and not _NGLD & set(lane_flags):
            flags += ["--n-gpu-layers-draft", layers]
        return flags

    def rpc_worker_command(self, binary: str, address: str, port: int, threads: int | None) -> list[str]:
        """ggml's `rpc-server` (no authentication: bound to the link address only, never every interface)."""
        return [binary, "--host", address, "--port", str(port), *(["--threads", str(threads)] if threads else [])]

    def rpc_flags(self, endpoints: list[str]) -> list[str]:
        # Every layer goes to the RPC devices (default -ngl): weights and KV cache live across the link.
        return ["--rpc", ",".join(endpoints)]

    def boot_facts(self, log: str, version: str | None = None) -> BootFacts:
        facts = BootFacts()
        if m := _SLOTS.search(log):
            facts.max_running_requests, facts.context_per_slot = int(m[1]), int(m[2])
        if m := _DRAFT_LOADED.search(log):
            facts.draft_model_loaded = True
            facts.extra["draft_model"] = m[1]
        if m := _SPEC_IMPL.search(log) or _SPEC_TYPE.search(log):
            facts.speculative_type = m[1]
        # What the server actually offloaded, as it says it (target, then drafter).
        for role, m in zip(("offloaded_layers", "draft_offloaded_layers"), _OFFLOADED.finditer(log)):
            facts.extra[role] = f"{m[1]}/{m[2]}"
        for role, (_, mib) in zip(("gpu_model_buffer_mib", "draft_gpu_model_buffer_mib"), _GPU_BUFFER.findall(log)):
            facts.extra[role] = float(mib)
        if m := _GPU_DEVICE.search(log):
            facts.extra["gpu_device"] = f"{m[1]} {m[2]}"
        return facts

    def info_facts(self, facts: BootFacts, info: dict | list) -> BootFacts:
        """/slots: per slot `speculative` (a draft context exists) and, after a request, `params["speculative.types"]`
        ("none,draft-simple"); /props says "none" even while drafting."""
        if not (slots := info if isinstance(info, list) else []):
            return facts
        if facts.max_running_requests is None:
            facts.max_running_requests = len(slots)
        facts.extra["speculative_context"] = any(bool(s.get("speculative")) for s in slots)
        for slot in slots:
            params = slot.get("params") or {}
            if types := [t for t in str(params.get("speculative.types", "")).split(",") if t and t != "none"]:
                facts.speculative_type = ",".join(types)
            # The sampling the last request on this slot actually ran with (safety.py: greedy expected).
            for key in ("temperature", "top_k"):
                if isinstance(params.get(key), (int, float)):
                    facts.extra[key] = params[key]
        return facts

    def acceptance(self, before: Metrics, after: Metrics, requests: list[RequestRecord], k: int) -> Acceptance | None:
        def delta(name: str) -> float:
            return after.get(_P + name) - before.get(_P + name)

        steps = delta("spec_decode_num_drafts_total")
        if steps <= 0:
            return None
        accepted = delta("spec_decode_num_accepted_tokens_total")
        per_pos = [delta(f'spec_decode_num_accepted_tokens_per_pos_total{{position="{i}"}}') for i in range(k)]
        return Acceptance.over(steps, accepted, delta("spec_decode_num_draft_tokens_total"), per_pos, "counters")

    def completion_request(self, prompt: str, max_tokens: int) -> RequestSpec:
        # Native /completion: its final chunk carries `timings` with draft_n / draft_n_accepted.
        return RequestSpec(path="/completion", body={"prompt": prompt, "n_predict": max_tokens, "temperature": 0.0,
                                                     "top_k": 1, "stream": True, "cache_prompt": False})

    def parse_event(self, data: dict) -> StreamEvent:
        # llama-server sends no event for a token that leaves the text in an incomplete UTF-8
        # sequence (server-context.cpp `process_token`): the next event carries the held bytes, and
        # its `tokens_predicted` (the slot's n_gen) has moved on by every token since. So the
        # running count, not one token per event, is what each event carried.
        total = data.get("tokens_predicted")
        total = int(total) if isinstance(total, (int, float)) and not isinstance(total, bool) else None
        if not data.get("stop"):
            return StreamEvent(text=data.get("content", ""), tokens=len(data.get("tokens") or []) or 1,
                               tokens_total=total)
        timings = data.get("timings") or {}
        spec: dict[str, float | list[float]] | None = None if "draft_n" not in timings else {
            "draft_n": float(timings["draft_n"]), "draft_n_accepted": float(timings.get("draft_n_accepted", 0))}
        return StreamEvent(
            text=data.get("content", ""), tokens=0, done=True, tokens_total=total, spec=spec,
            completion_tokens=int(data.get("tokens_predicted", timings.get("predicted_n", 0))),
            prompt_tokens=data.get("tokens_evaluated", timings.get("prompt_n")),
            finish_reason="length" if data.get("stop_type") == "limit" else "stop",
            truncated=bool(data.get("truncated")),  # context full, or shifted (server-context.cpp)
            timings={k: float(v) for k, v in timings.items() if isinstance(v, (int, float)) and not isinstance(v, bool)} or None)

    # --- Agentic flags (tools/server, common/chat.cpp, common/arg.cpp of the pinned tree) -----
    # No tool-call parser flag: with Jinja templates (default on) the server renders the template
    # with probe messages and derives the tool-call and thinking markup from the diffs
    # (common/chat-diff-analyzer.cpp); <tool_call>{"name", "arguments"}</tool_call> gets a JSON tool
    # parser and a lazy grammar; a template without tools gets none (calls come back as text).
    # `--reasoning-format deepseek` moves thinking into `reasoning_content`, `none` leaves it.
    # `chat_template_kwargs` reach the template (`enable_thinking` is also read by the server:
    # server-common.cpp `oaicompat_chat_params_parse`).

    def agentic_flags(self, agentic: Agentic, chat_template: str | None) -> list[str]:
        flags: list[str] = []
        if chat_template is not None:
            flags += ["--jinja", "--chat-template-file", chat_template]
        if agentic.reasoning_parser is not None:
            flags += ["--reasoning-format", agentic.reasoning_parser]
        elif agentic.reasoning:
            flags += ["--reasoning-format", "deepseek"]
        return flags

    # --- Teacher-forced scoring (KL gate) ---------------------------------------------------
    # No prompt-logprob mode (`echo` is refused): each position is probed with its prefix as a
    # token-id prompt, `n_predict: 1`, and `logit_bias` makes the server *sample the forced
    # token*, so `logprob` is the forced token's and `top_logprobs[0]` the argmax, both from the
    # raw logits without `post_sampling_probs` (server-context.cpp `populate_token_probs` ->
    # server-common.cpp `get_token_probabilities`: softmax over the vocabulary, bias not applied).
    # `cache_prompt` makes each further prefix cost one token; a sequence's first probe recomputes
    # its prompt, so its numbers never depend on the slot's previous prompt (batched prefill and
    # one-token decode differ in the last bits, which the exactness check would see).

    def tokenize_request(self, text: str) -> RequestSpec:
        return RequestSpec(path="/tokenize", body={"content": text, "add_special": True})

    def greedy_tokens_request(self, tokens: list[int], max_tokens: int, ignore_eos: bool) -> RequestSpec:
        return RequestSpec(path="/completion", body={
            "prompt": tokens, "n_predict": max_tokens, "temperature": 0.0, "top_k": 1, "ignore_eos": ignore_eos,
            "cache_prompt": False, "stream": False, "return_tokens": True, "response_fields": ["tokens", "stop_type"]})

    parse_greedy_tokens = Engine.parse_tokenize  # {"tokens": [...]} as /tokenize answers

    def forced_probes(self, tokens: list[int], start: int) -> list[ForcedProbe]:
        return [ForcedProbe(path="/completion", body={
            "prompt": tokens[:i], "n_predict": 1, "temperature": 0.0, "n_probs": 1, "logit_bias": [[tokens[i], 1.0e4]],
            "cache_prompt": i > start, "stream": False, "response_fields": ["completion_probabilities"],
        }, positions=[i], forced=[tokens[i]]) for i in range(start, len(tokens))]

    def parse_forced(self, probe: ForcedProbe, data: dict) -> list[ForcedScore]:
        (position,), (forced,) = probe.positions, probe.forced
        probs = data.get("completion_probabilities")
        if not probs:
            if probe.body["n_probs"] != 1:
                raise ValueError(f"llama-server reported no probabilities for position {position}")
            # The forced token is an incomplete UTF-8 sequence, whose probabilities the server withholds
            # (`process_token`): sample a plain ASCII token and find the forced one in the whole
            # vocabulary (the server clamps `n_probs` to its size).
            body = {**probe.body, "logit_bias": [["a", 1.0e4]], "n_probs": 1 << 20}
            raise ProbeRetry(probe.model_copy(update={"body": body}))
        entry = probs[0]
        top = entry.get("top_logprobs") or []
        if not top:
            raise ValueError(f"llama-server sent no top_logprobs for position {position} (post_sampling_probs?)")
        found = [entry["logprob"]] if entry["id"] == forced else [t["logprob"] for t in top if t["id"] == forced]
        if not found:
            raise ValueError(f"forced token {forced} missing from the {len(top)} probabilities at position {position}")
        return [ForcedScore(position=position, logprob=float(found[0]), argmax=int(top[0]["id"]))]
