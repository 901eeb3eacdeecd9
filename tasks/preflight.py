"""Preflight: everything a lane needs, checked before an expensive boot.

A failed precondition is not an error of the run: the lane is skipped with the reason and
every other lane goes on.
"""

from __future__ import annotations

import shutil
import socket
from pathlib import Path

from prefect import task
from prefect.cache_policies import NO_CACHE
from pydantic import BaseModel

from tasks.build import BuildError, llama_cpp_bin_dir, llama_cpp_identity
from tasks.config import FileRef, Host, Lane
from tasks.files import sha256_of


class ModelFacts(BaseModel):
    role: str
    path: str
    bytes: int
    sha256: str


class Preflight(BaseModel):
    ok: bool
    reason: str = ""
    binary: str = ""
    engine_identity: dict[str, str] = {}
    models: list[ModelFacts] = []


def resolve(base_dir: Path, path: str) -> Path:
    p = Path(path)
    return p if p.is_absolute() else (base_dir / p).resolve()


def _check_file(role: str, ref: FileRef, base_dir: Path) -> ModelFacts | str:
    path = resolve(base_dir, ref.path)
    if not path.is_file():
        return f"{role} file {path} is missing"
    size = path.stat().st_size
    if ref.bytes is not None and size != ref.bytes:
        return f"{role} file {path} has {size} bytes, the lane declares {ref.bytes}"
    digest = sha256_of(path)
    if ref.sha256 is not None and digest != ref.sha256:
        return f"{role} file {path} has sha256 {digest[:12]}..., the lane declares {ref.sha256[:12]}..."
    return ModelFacts(role=role, path=str(path), bytes=size, sha256=digest)


def port_free(address: str, port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        # As servers bind: a port in TIME_WAIT after the previous boot is free to use.
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((address, port))
        except OSError:
            return False
    return True


def _binary(lane: Lane) -> tuple[str, dict[str, str]] | str:
    if lane.binary is None and lane.engine == "llamacpp":
        try:
            bin_dir = llama_cpp_bin_dir()
        except BuildError as e:
            return str(e)
        return str(bin_dir / "llama-server"), llama_cpp_identity(bin_dir)
    if lane.binary is None:
        return f"lane declares no binary for engine {lane.engine} (set 'binary', or 'image' once container lanes are available)"
    found = shutil.which(lane.binary)
    if not found:
        return f"engine binary {lane.binary!r} not found"
    return found, {"path": found, "sha256": sha256_of(found)}


@task(name="preflight", cache_policy=NO_CACHE)
def preflight(lane_name: str, lane: Lane, host: Host, base_dir: Path) -> Preflight:
    """Binary present, model files present with declared bytes (and sha256), port free."""
    if host.transport != "local":
        return Preflight(ok=False, reason=f"host {lane.host} is reached over {host.transport}, "
                         "which this version of lanebench cannot drive yet; only local hosts run")
    if lane.image is not None:
        return Preflight(ok=False, reason="container lanes (image@sha256) are not available in this version")
    found = _binary(lane)
    if isinstance(found, str):
        return Preflight(ok=False, reason=found)
    binary, identity = found
    models = []
    for role, ref in (("model", lane.model), ("drafter", lane.drafter)):
        if ref is None:
            continue
        facts = _check_file(role, ref, base_dir)
        if isinstance(facts, str):
            return Preflight(ok=False, reason=facts, binary=binary, engine_identity=identity)
        models.append(facts)
    if not port_free(host.address, lane.port):
        return Preflight(ok=False, reason=f"port {lane.port} on {host.address} is already in use",
                         binary=binary, engine_identity=identity, models=models)
    return Preflight(ok=True, binary=binary, engine_identity=identity, models=models)
