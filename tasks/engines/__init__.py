"""Engine adapters behind one interface; stages look them up by the lane's `engine` name."""

from __future__ import annotations

from tasks.engines.base import Engine
from tasks.engines.llamacpp import LlamaCpp


def engine_for(name: str) -> Engine:
    """The adapter for a lane's engine name (validated by the config schema)."""
    from tasks.engines.sglang import SGLang
    from tasks.engines.vllm import VLLM

    adapters: dict[str, type[Engine]] = {"llamacpp": LlamaCpp, "sglang": SGLang, "vllm": VLLM}
    return adapters[name]()


__all__ = ["Engine", "engine_for"]
