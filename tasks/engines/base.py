"""The one interface every engine adapter implements: stages talk to an `Engine` (launch, health,
boot log, counters, acceptance in lanebench's single definition), never `if engine == ...`."""

from __future__ import annotations

import json
from abc import ABC, abstractmethod
from functools import cache
from typing import Any, ClassVar

import msgspec
import orjson
from prometheus_client.parser import text_string_to_metric_families

from tasks.inventory.flag_conflicts import RULES
from tasks.inventory.models import Agentic, Lane
from tasks.wire.kl_probes import ForcedProbe, ForcedScore
from tasks.wire.records import RequestRecord, RequestSpec, StreamEvent
from tasks.engines.build import BuildError
from tasks.engines.facts import Acceptance, BootFacts, DraftPlan, LoggedAcceptance, Metrics, PlannedCap


_TAIL = 3  # events of another kind a read may end with and still be parsed together (Engine.stream_tokens)


_RAW_ARRAY = msgspec.json.Decoder(list[msgspec.Raw])  # a read's array, each element's bytes as they are


@cache
def _token_decoders(chunk: type) -> tuple[msgspec.json.Decoder, msgspec.json.Decoder]:
    """One event's and one read's decoder for an engine's token chunk (Engine.token_chunk)."""
    return msgspec.json.Decoder(chunk), msgspec.json.Decoder(list[chunk])  # type: ignore[valid-type]


def _loads(payload: bytes) -> Any:
    """orjson on the stream's hot path (json.loads was a third of the client's CPU); the standard
    parser where orjson refuses what it accepts (NaN, Infinity)."""
    try:
        return orjson.loads(payload)
    except orjson.JSONDecodeError:
        return json.loads(payload)


class Engine(ABC):
    name: ClassVar[str]
    # Built from a pin (scripts/build-llama-cpp.sh): a lane without `binary` runs that build, and
    # a lane's own binary is compared with the pin.
    pinned_build: ClassVar[bool] = False
    loads_model_folder: ClassVar[bool] = True  # a Hugging Face folder (config.json, weights, tokenizer)
    model_magic: ClassVar[bytes | None] = None  # a model file's first bytes and format name (b"GGUF")
    serves_quantized_gguf: ClassVar[bool] = False  # the KL gate can llama-quantize a candidate for it
    slots_flags: ClassVar[tuple[str, ...]] = ()  # flags setting the cap a lane calls `slots` (an arm's own wins)
    health_path: ClassVar[str] = "/health"
    metrics_path: ClassVar[str] = "/metrics"
    info_path: ClassVar[str | None] = None  # a JSON endpoint describing the resolved server settings
    # Speculation counters every drafter lane is gated on (tasks/stages/safety.py): verification
    # steps with a draft, draft tokens proposed. None: no such counter.
    draft_counter: ClassVar[str | None] = None
    draft_tokens_counter: ClassVar[str | None] = None
    queue_gauge: ClassVar[str | None] = None  # the metric counting requests waiting past the running cap
    local_binary_name: ClassVar[str | None] = None  # what local_build runs, as `lanebench plan` shows it

    @property
    def api_key_env(self) -> str | None:
        """The variable the server reads its API key from (the inventory's LaneRules hold it)."""
        return RULES[self.name].api_key_env

    @property
    def spans_nodes_by_rpc(self) -> bool:
        """Spans hosts with its own RPC workers (`rpc`), not node flags on every host (`nodes`)."""
        return RULES[self.name].rpc

    def effective_k(self, metrics: Metrics) -> int | None:
        """The draft width the server resolved, as its own counters state it (None: not stated)."""
        return None

    def effective_k_of(self, requests: list[RequestRecord]) -> int | None:
        """The draft width the server resolved, as the requests' speculation fields state it."""
        return None

    def draft_window(self, before: Metrics, after: Metrics, requests: list[RequestRecord]) -> tuple[float, float] | None:
        """(verification steps with a draft, draft tokens proposed) over a window (None: not counted)."""
        if self.draft_counter is None or self.draft_tokens_counter is None:
            return None
        return (after.total(self.draft_counter) - before.total(self.draft_counter),
                after.total(self.draft_tokens_counter) - before.total(self.draft_tokens_counter))

    # --- K, converted once per engine (facts.py DraftPlan) --------------------------------------

    def method_name(self, method: str) -> str:
        """A lane's speculative.method as the release spells it."""
        return method

    def same_method(self, given: str, declared: str) -> bool:
        """Whether a method flag's value names the lane's declared method to this engine."""
        return self.method_name(given).lower() == self.method_name(declared).lower()

    def draft_plan(self, argv: list[str]) -> DraftPlan | None:
        """What the engine will draft for this argv, as the release resolves it (the last repeated
        flag wins). None: flags are checked field by field (tasks/inventory/flag_conflicts.py)."""
        return None

    def invalid_speculation(self, log: str) -> str | None:
        """The server's own words when its speculation output is not valid (synthetic acceptance)."""
        return None

    def acceptance_log_interval_s(self, env: dict[str, str]) -> float | None:
        """How often the server logs its own acceptance summary (None: never); the probe waits this
        long around each class's window so the lines between the waits describe that window."""
        return None

    def logged_acceptance(self, log: str, k: int) -> LoggedAcceptance | None:
        """The server's own acceptance lines in `log` (one window's), summed (None: no line)."""
        return None

    def local_build(self) -> tuple[str, dict[str, str]]:
        """(executable, manifest identity) on this machine for a lane without `binary`, or BuildError."""
        raise BuildError(f"lane declares no binary for engine {self.name} (set 'binary', or run it from a pinned 'image')")

    @abstractmethod
    def launch_command(self, lane: Lane, binary: str, host: str) -> list[str]:
        """argv that starts the server for this lane, listening on host:lane.port."""

    def healthy(self, status_code: int, body: str) -> bool:
        return status_code == 200

    @abstractmethod
    def boot_facts(self, log: str, version: str | None = None) -> BootFacts:
        """Parse what the server resolved at boot (running-request cap, context, speculation),
        in the log format of `version` (None: unknown, every known format is tried)."""

    def info_facts(self, facts: BootFacts, info: dict | list) -> BootFacts:
        """Complete the log's boot facts from the info endpoint's JSON (default: nothing to add)."""
        return facts

    def version_of(self, log: str, info: dict | list | None) -> str | None:
        """The engine release that booted, from its log or its info endpoint (None: not stated)."""
        return info["version"] if isinstance(info, dict) and isinstance(info.get("version"), str) else None

    def metrics(self, text: str) -> Metrics:
        """Parse Prometheus text exposition into {series: value}; labels sorted into the key."""
        values: dict[str, float] = {}
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                key = sample.name
                if sample.labels:
                    key += "{" + ",".join(f'{k}="{v}"' for k, v in sorted(sample.labels.items())) + "}"
                values[key] = float(sample.value)
        return Metrics(values=values)

    @abstractmethod
    def acceptance(self, before: Metrics, after: Metrics, requests: list[RequestRecord], k: int) -> Acceptance | None:
        """Acceptance over the window between two scrapes and its requests (None: no verification step)."""

    @abstractmethod
    def completion_request(self, prompt: str, max_tokens: int) -> RequestSpec:
        """A greedy, streamed completion request that does not reuse a cached prompt."""

    @abstractmethod
    def parse_event(self, data: dict) -> StreamEvent:
        """One decoded streaming chunk in the engine's own shape -> StreamEvent."""

    def parse_sse_line(self, line: str) -> StreamEvent | None:
        """Server-sent events: `data: {...}` lines; `data: [DONE]` ends the stream."""
        if not line.startswith("data:"):
            return None
        payload = line[5:].strip()
        if payload == "[DONE]":
            return StreamEvent(done=True)
        return self.parse_event(json.loads(payload))

    def cpu_only_env(self) -> dict[str, str]:
        """Keeps the server off every GPU on a `gpus: 0` host: a CUDA llama-server at `-ngl 0` still
        makes a CUDA context and compute buffers (~800 MiB on an H200)."""
        return {"CUDA_VISIBLE_DEVICES": ""}

    # The fields of a plain token event that token_event reads, as a msgspec Struct (None: the
    # engine has no token fast path; llama.cpp keeps a running count). Decoded into it, an event
    # skips every other field: a dict of all of them cost more than the rest of a token's work.
    token_chunk: ClassVar[type[msgspec.Struct] | None] = None

    def token_event(self, chunk: Any) -> tuple[str, int] | None:
        """A decoded token_chunk that is a plain token event, as (text, tokens); None for anything
        else (final, usage, error), which parse_event reads."""
        return None

    def stream_token(self, raw: bytes) -> tuple[str, int] | None:
        """The client's hot path for one event: the common event off the wire as (text, tokens),
        without building a StreamEvent; None: read `raw` with parse_stream_event. JSON that is
        malformed (invalid UTF-8 in any field too), or of another shape than token_chunk, raises
        ValueError; JSON nested deeper than msgspec goes (orjson's limit is fixed) is left to
        parse_stream_event."""
        if self.token_chunk is None or not raw.startswith(b"data: {") or b"\n" in raw:
            return None
        payload = raw[6:]
        if not payload.isascii():
            payload.decode()  # msgspec skips the fields the Struct does not read without checking them
        try:
            return self.token_event(_token_decoders(self.token_chunk)[0].decode(payload))
        except RecursionError:
            return None

    def stream_tokens(self, raws: list[bytes]) -> list[tuple[str, int] | None] | None:
        """stream_token for every event of one read, decoded as one JSON array: a zero-delay stream
        brings hundreds of events a read, and a parse and two calls an event were most of the CPU
        a token. The read's last events may be of another kind (`[DONE]`, a comment): they come
        back None, for parse_stream_event. None for the whole read where the rest is not all
        one-line `data: {` events that each hold exactly one element of the array, of token_chunk's
        shape, in valid UTF-8: then stream_token, event by event, says which event is what."""
        if self.token_chunk is None:
            return None
        n = len(raws)
        while n and not raws[n - 1].startswith(b"data: {") and len(raws) - n < _TAIL:
            n -= 1
        if not n:
            return None
        blob = b"\n\n".join(raws[:n])
        if not blob.startswith(b"data: {") or blob.count(b"\n") != 2 * (n - 1):
            return None  # a raw newline cannot sit inside one-line JSON: these are the separators
        array = b"[" + blob[6:].replace(b"\n\ndata: ", b",") + b"]"
        if len(array) != len(blob) - 4 - 7 * (n - 1):  # a separator not followed by `data: `
            return None
        try:
            if not array.isascii():
                array.decode()
            # Each element must be one event's whole payload: a string or array one event leaves
            # open would take the next event's comma inside it, and `{..},{..}` in one event is two.
            spans = _RAW_ARRAY.decode(array)
            if len(spans) != n or list(map(len, spans)) != [len(r) - 6 for r in raws[:n]]:
                return None
            chunks = _token_decoders(self.token_chunk)[1].decode(array)
        except (ValueError, RecursionError):  # msgspec's DecodeError is a ValueError, as is bad UTF-8
            return None
        token_event = self.token_event
        return [token_event(c) for c in chunks] + [None] * (len(raws) - n)

    def parse_stream_event(self, raw: bytes) -> StreamEvent | None:
        """One server-sent event off the wire: None for a comment (llama-server's `:` ping); an `error`
        event or body is the server's error in its words; malformed JSON raises ValueError."""
        if raw.startswith(b"data: {") and b"\n" not in raw:  # the common event: one data line of JSON
            body = raw[6:]
            return self._parse_data(_loads(body), body, b"message")
        data_lines, kind = [], b"message"
        for line in raw.split(b"\n"):
            if not line or line.startswith(b":"):
                continue
            name, _, value = line.partition(b":")
            value = value[1:] if value.startswith(b" ") else value
            if name == b"data":
                data_lines.append(value)
            elif name == b"event":
                kind = value.strip()
            elif name == b"error":  # not an SSE field, but some servers write it
                return StreamEvent(done=True, finish_reason="error", error=value.decode(errors="replace")[:500])
        if not data_lines:
            return None
        payload = b"\n".join(data_lines).strip()
        if payload == b"[DONE]":
            return StreamEvent(done=True)
        return self._parse_data(_loads(payload), payload, kind)

    def _parse_data(self, data: Any, payload: bytes, kind: bytes) -> StreamEvent:
        if not isinstance(data, dict):
            raise ValueError(f"event is not a JSON object: {payload[:200]!r}")
        if "error" in data or kind == b"error" or data.get("object") == "error":
            err = data.get("error", data)
            message = err.get("message", err) if isinstance(err, dict) else err
            return StreamEvent(done=True, finish_reason="error", error=str(message)[:500])
        return self.parse_event(data)

    # --- Chat, for the correctness gates (smoke, tool gate, needles, thinking) -----------------

    def chat_request(self, messages: list[dict[str, Any]], max_tokens: int, temperature: float = 0.0,
                     tools: list[dict[str, Any]] | None = None, tool_choice: str | None = None,
                     template_kwargs: dict[str, Any] | None = None) -> RequestSpec:
        """A non-streamed OpenAI chat request; `template_kwargs` travel as `chat_template_kwargs`."""
        body: dict[str, Any] = {"messages": messages, "max_tokens": max_tokens, "temperature": temperature,
                                "stream": False}
        if tools:
            body["tools"] = tools
            body["tool_choice"] = tool_choice or "auto"
        if template_kwargs:
            body["chat_template_kwargs"] = template_kwargs
        return RequestSpec(path="/v1/chat/completions", body=body)  # common to llama.cpp, SGLang and vLLM

    def agentic_flags(self, agentic: Agentic, chat_template: str | None) -> list[str]:
        """Launch flags for what the lane serves (tool calls, reasoning, the resolved template path)."""
        return []

    def offload_flags(self, gpus: int, has_drafter: bool, lane_flags: list[str]) -> list[str]:
        """Flags putting target and drafter where the host's `gpus` says (a lane's own flags win)."""
        return []

    def planned_cap(self, lane: Lane) -> PlannedCap | None:
        """The running-request cap the lane's config implies, before boot (None: only the log knows)."""
        return None

    # --- Serving across hosts (a lane's `nodes`; llama.cpp: its `rpc` plan) -------------------

    def listen_ports(self, argv: list[str], rank: int, spans_nodes: bool) -> list[tuple[int, str]]:
        """Ports node `rank`'s process listens on besides HTTP and the rendezvous, by its argv."""
        return []

    def node_flags(self, rank: int, nnodes: int, master: str, port: int) -> list[str]:
        """Flags making this process node `rank` of `nnodes` at master:port (rank 0 serves HTTP)."""
        raise NotImplementedError(f"the {self.name} adapter spans hosts with its rpc plan, not node flags")

    def rpc_worker_command(self, binary: str, address: str, port: int, threads: int | None) -> list[str]:
        """argv of the worker that serves this engine's layers on another host, bound to `address`."""
        raise NotImplementedError(f"the {self.name} adapter has no RPC backend")

    def rpc_flags(self, endpoints: list[str]) -> list[str]:
        """Launch flags that put the model on the RPC workers at `endpoints` ("addr:port")."""
        raise NotImplementedError(f"the {self.name} adapter has no RPC backend")

    # --- Teacher-forced scoring, for the KL gate (not abstract: an adapter without it says so) ---

    def tokenize_request(self, text: str) -> RequestSpec:
        """Tokenize `text` as a prompt is tokenized, special tokens (BOS) included (vLLM's and SGLang's
        /tokenize: {"prompt", "add_special_tokens"} -> {"tokens", "count", ...})."""
        return RequestSpec(path="/tokenize", body={"prompt": text, "add_special_tokens": True})

    def parse_tokenize(self, data: dict) -> list[int]:
        return [int(t) for t in data["tokens"]]

    def greedy_tokens_request(self, tokens: list[int], max_tokens: int, ignore_eos: bool) -> RequestSpec:
        """A non-streamed greedy continuation of a token-id prompt that returns the token ids."""
        raise NotImplementedError(f"the {self.name} adapter cannot generate from token ids")

    def parse_greedy_tokens(self, data: dict) -> list[int]:
        raise NotImplementedError(f"the {self.name} adapter cannot generate from token ids")

    def forced_probes(self, tokens: list[int], start: int) -> list[ForcedProbe]:
        """Requests that score `tokens[start:]` teacher-forced, in the order they must be sent."""
        raise NotImplementedError(f"the {self.name} adapter cannot score teacher-forced")

    def parse_forced(self, probe: ForcedProbe, data: dict) -> list[ForcedScore]:
        """The forced tokens' log-probabilities and argmax per probed position (or `ProbeRetry`)."""
        raise NotImplementedError(f"the {self.name} adapter cannot score teacher-forced")


def parser_flags(agentic: Agentic, chat_template: str | None, tool_choice_flags: tuple[str, ...] = ()) -> list[str]:
    """SGLang's and vLLM's spelling of a lane's agentic declarations (`tool_choice_flags`: what else the
    engine needs before it emits tool calls); without the parsers agents break silently."""
    flags: list[str] = []
    if agentic.tool_parser is not None:
        flags += [*tool_choice_flags, "--tool-call-parser", agentic.tool_parser]
    if agentic.reasoning_parser is not None:
        flags += ["--reasoning-parser", agentic.reasoning_parser]
    if chat_template is not None:
        flags += ["--chat-template", chat_template]
    return flags
