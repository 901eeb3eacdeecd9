"""KL verdicts that measure nothing, flagged: a reference that is itself quantized, a candidate
with the reference's exact bytes, a reference that saw less context than a candidate.

The seeds' KL gate scored NVFP4 candidates against the FP8 original served as an oracle; a
gate whose reference is another quant measures the distance between two quants, and a
candidate byte-identical to its reference scores 0 whatever the candidate was meant to be.
"""

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


def kl_flags(reference: str, lanes: dict[str, dict[str, Any]]) -> list[str]:
    """`lanes`: name -> {path, sha256, quantize, context} as each lane actually ran."""
    ref = lanes[reference]
    out = []
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
