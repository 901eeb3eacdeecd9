"""Engine adapters behind one interface; stages look them up by the lane's `engine` name."""

from __future__ import annotations

from importlib import import_module

from tasks.engines.base import Engine

_ADAPTERS = {"llamacpp": "tasks.engines.llamacpp:LlamaCpp", "sglang": "tasks.engines.sglang:SGLang",
             "vllm": "tasks.engines.vllm:VLLM"}


def engine_for(name: str) -> Engine:
    """The adapter for a lane's engine name (the config schema admits only known names)."""
    module, cls = _ADAPTERS[name].split(":")
    return getattr(import_module(module), cls)()


__all__ = ["Engine", "engine_for"]
