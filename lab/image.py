"""The rehearsal engine image: the project's own llama.cpp build in a `FROM scratch` image.

No base image: the context holds llama-server, rpc-server and exactly the libraries `ldd` lists
(plus an empty /tmp), so the image comes from the pinned build alone, nothing fetched. Labelled
with the build identity, tagged with the pin's first 12 characters; a lane pins it by the
registry's manifest digest, never the tag. The legacy builder (`DOCKER_BUILDKIT=0`): buildx is
not installed, and a scratch image with COPY needs no more.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import tempfile
from pathlib import Path

from lab.docker import docker

REPOSITORY = "lanebench/llama-server"
BINARIES = ("llama-server", "rpc-server")
LABEL_BUILD = "lanebench.llama_cpp.build"  # the build's pin (the sdist sha256 the build is keyed by)
LABEL_SERVER = "lanebench.llama_server.sha256"  # the binary itself
_REGISTRY = re.compile(r"^[A-Za-z0-9.-]+(:[0-9]{1,5})?$|^\[[0-9A-Fa-f:]+\](:[0-9]{1,5})?$")
_DIGEST = re.compile(r"digest: (sha256:[0-9a-f]{64})")


class ImageBuildError(RuntimeError):
    """Building or pushing the engine image failed; carries docker's own message."""


def build_identity(bin_dir: Path) -> dict[str, str]:
    """The labels that say which build is inside: the pin and the llama-server binary's sha256."""
    from tasks.engines.build import llama_cpp_identity

    source = (bin_dir.parent / "SOURCE").read_text() if (bin_dir.parent / "SOURCE").exists() else ""
    pin = re.search(r"sdist_sha256=([0-9a-f]{64})", source)
    build = pin.group(1) if pin else bin_dir.parent.name
    if not re.fullmatch(r"[0-9a-f]{12,64}", build):
        raise ImageBuildError(f"{bin_dir}: cannot tell the build's sha (no SOURCE pin, folder {build!r})")
    return {LABEL_BUILD: build, LABEL_SERVER: llama_cpp_identity(bin_dir)["llama_server_sha256"]}


def _docker(docker_host: str, *args: str, timeout: float) -> subprocess.CompletedProcess:
    try:
        return docker(docker_host, *args, timeout=timeout, env={**os.environ, "DOCKER_BUILDKIT": "0"})
    except subprocess.TimeoutExpired as e:
        raise ImageBuildError(f"docker {args[0]} did not finish within {timeout:.0f}s") from e


def _libraries(binary: Path) -> list[Path]:
    out = subprocess.run(["ldd", str(binary)], capture_output=True, text=True, check=True).stdout
    if missing := [line.strip() for line in out.splitlines() if "not found" in line]:
        raise ImageBuildError(f"{binary}: a shared library is missing: {missing[0]}")
    return [Path(p) for p in re.findall(r"(?:=>\s*)?(/\S+)\s+\(0x", out)]


def _context(bin_dir: Path, folder: Path) -> None:
    rootfs = folder / "rootfs"
    rootfs.mkdir()
    files = {Path("/" + name): bin_dir / name for name in BINARIES}
    files |= {lib: lib for name in BINARIES for lib in _libraries(bin_dir / name)}
    for dest, src in files.items():
        target = rootfs / dest.relative_to("/")
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(src.resolve(), target)  # the file itself at the path the loader asks for
    (rootfs / "tmp").mkdir()
    (rootfs / "tmp").chmod(0o1777)
    (folder / "Dockerfile").write_text('FROM scratch\nCOPY rootfs/ /\nENTRYPOINT ["/llama-server"]\n')


def build_and_push(docker_host: str, registry: str, bin_dir: Path | None = None) -> str:
    """Build (unless already built from this build) and push the engine image; return
    `<registry>/lanebench/llama-server@sha256:<manifest digest>`."""
    if not _REGISTRY.fullmatch(registry):
        raise ValueError(f"registry {registry!r} must be host[:port]")
    if bin_dir is None:
        from tasks.engines.build import llama_cpp_bin_dir

        bin_dir = llama_cpp_bin_dir()
    identity = build_identity(bin_dir)
    tag = f"{registry}/{REPOSITORY}:{identity[LABEL_BUILD][:12]}"

    def same_build() -> bool:
        r = _docker(docker_host, "image", "inspect", "--format", "{{json .Config.Labels}}", tag, timeout=60)
        return r.returncode == 0 and all((json.loads(r.stdout) or {}).get(k) == v for k, v in identity.items())

    # Already here, or already in the registry (a pull of a present tag moves only what is missing).
    if not same_build() and not (_docker(docker_host, "pull", tag, timeout=300).returncode == 0 and same_build()):
        with tempfile.TemporaryDirectory(prefix="lanebench-image-") as folder:
            _context(bin_dir, Path(folder))
            labels = [arg for k, v in identity.items() for arg in ("--label", f"{k}={v}")]
            r = _docker(docker_host, "build", "--network", "none", "--tag", tag, *labels, folder, timeout=900)
            if r.returncode != 0:
                raise ImageBuildError(f"docker build of {tag} failed (exit {r.returncode}): {(r.stderr or r.stdout)[-2000:]}")
    r = _docker(docker_host, "push", tag, timeout=600)
    if r.returncode != 0:
        raise ImageBuildError(f"docker push of {tag} to {registry} failed (exit {r.returncode}): "
                              f"{(r.stderr or r.stdout).strip()[-2000:]}")
    m = _DIGEST.search(r.stdout)
    if m is None:
        raise ImageBuildError(f"docker push of {tag} printed no digest: {r.stdout[-500:]}")
    return f"{registry}/{REPOSITORY}@{m.group(1)}"
