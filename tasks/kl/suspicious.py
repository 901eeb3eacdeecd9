"""KL verdicts that measure nothing, flagged: a quantized reference (the seeds scored NVFP4 against the
FP8 original; another quant measures quant to quant), a candidate with the reference's exact bytes
(scores 0 whatever it was meant to be), a reference that saw less context than a candidate."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

# Weight formats that are quantized (GGUF types, and the names checkpoints carry).
_QUANT = re.compile(r"(?i)(?:^|[-_.])(i?q[1-8](?:_[0-9a-z]+)*|nvfp4|mxfp4|fp8|int[48]|awq|gptq|bnb|[48]bit)(?:[-_.]|$)")


def quantized(path: str | None, quantize_type: str | None) -> str | None:
    """Why this model counts as quantized, or None."""
    if quantize_type:
        return f"made by llama-quantize as {quantize_type}"
    if path and (m := _QUANT.search(Path(path).name)):
        return f"its file name says {m[1]}"
    return None


# Flags that set the KV cache's precision (llama.cpp, vLLM, SGLang) and the values that keep it exact.
_KV_FLAGS = {"--cache-type-k", "-ctk", "--cache-type-v", "-ctv", "--kv-cache-dtype"}
_KV_EXACT = {"f16", "f32", "bf16", "auto", "float16", "bfloat16", "float32"}


def quantized_kv_cache(flags: list[str]) -> str | None:
    """`--cache-type-k q8_0` when the flags quantize the KV cache, else None."""
    for i, flag in enumerate(flags):
        name, _, value = flag.partition("=")
        if name in _KV_FLAGS:
            value = value or (flags[i + 1] if i + 1 < len(flags) else "")
            if value.lower() not in _KV_EXACT:
                return f"{name} {value}"
    return None


def kl_flags(reference: str, lanes: dict[str, dict[str, Any]]) -> list[str]:
    """`lanes`: name -> {path, sha256, quantize, context, flags} as each lane actually ran."""
    ref = lanes[reference]
    out = []
    if kv := quantized_kv_cache(ref.get("flags") or []):
        out.append(f"the reference {reference} was served with a quantized KV cache ({kv}): it is not an exact "
                   "reference, and every candidate's distance includes the cache's error; fix: serve the reference "
                   "with an f16 KV cache (remove the flag)")
    if why := quantized(ref.get("path"), ref.get("quantize")):
        out.append(f"the reference {reference} is itself quantized ({why}): the gate measures the distance to "
                   "another quant, not to the original; fix: serve the original weights (f16/bf16/the released "
                   "precision) as the reference")
    for name, lane in lanes.items():
        if name == reference:
            continue
        if lane.get("sha256") and lane.get("sha256") == ref.get("sha256"):
            out.append(f"candidate {name} has the reference's exact bytes (sha256 {str(ref['sha256'])[:12]}): its "
                       "KL of 0 says nothing about a candidate; fix: point it at the candidate's model or quantize it")
        if ref.get("context") and lane.get("context") and ref["context"] < lane["context"]:
            out.append(f"the reference {reference} ran with {ref['context']} tokens of context, candidate {name} with "
                       f"{lane['context']}: positions past {ref['context']} are not scored against the original; "
                       "fix: give the reference at least the candidates' context")
    return out
