"""Host preflight: the host a lane boots on is reachable and ready, checked where it lives.

Each fact is read through the host's `Transport` (boot's path), so it cannot pass for another
machine: reachable, docker answering (container lanes), GPU count and memory, free disk at the
models and artifacts paths, model files with the declared bytes and sha256. Hashing a 100 GB
checkpoint over SSH takes minutes, so the sha256 is cached by (host, address, path, size, mtime).
"""

from __future__ import annotations

import posixpath
from collections.abc import Sequence
from pathlib import Path

from pydantic import BaseModel

from tasks.inventory.models import FileRef, Host
from tasks.hosts.files import Sha256Cache
from tasks.hosts.transport import CommandResult, Transport, TransportError

MIN_FREE_BYTES = 256 * 2**20  # a run folder, its logs and a boot log


class GpuFacts(BaseModel):
    index: int
    name: str
    memory_total_mib: int
    memory_used_mib: int


class DiskFacts(BaseModel):
    role: str  # models | artifacts
    path: str
    measured_at: str  # the path df was run on (the nearest existing folder)
    avail_bytes: int


class FileFacts(BaseModel):
    path: str
    bytes: int
    mtime: int
    sha256: str | None = None
    sha256_cached: bool = False


class HostCheck(BaseModel):
    host: str
    ok: bool
    reason: str = ""
    reachable: bool = False
    docker_server: str | None = None  # the daemon's version, when asked and answering
    gpus: list[GpuFacts] = []
    disks: list[DiskFacts] = []
    files: list[FileFacts] = []


def host_folder(host: Host, path: str, base_dir: Path | None) -> str:
    """A folder of `host.paths` on the host: absolute as given; relative to the inventory's
    folder on a local host, to the login folder on a remote one."""
    if posixpath.isabs(path) or host.transport != "local":
        return path
    return str(((base_dir or Path.cwd()) / path).resolve())


def host_path(host: Host, path: str, base_dir: Path | None) -> str:
    """A model file on the host: as `host_folder`, but relative to the models folder on a remote host."""
    if posixpath.isabs(path) or host.transport == "local":
        return host_folder(host, path, base_dir)
    return posixpath.join(host.paths.models, path)


def _run(t: Transport, argv: list[str], deadline_s: float = 30.0) -> CommandResult:
    return t.run(argv, deadline_s=deadline_s, idempotent=True)


def _why(r: CommandResult, default: str = "") -> str:
    return (r.stderr.strip().splitlines() or [default or f"exit {r.exit_code}"])[-1]


def _docker(host_name: str, host: Host, t: Transport) -> str:
    argv = ["docker", *(["--host", host.docker_host] if host.docker_host else []),
            "version", "--format", "{{.Server.Version}}"]
    r = _run(t, argv)
    if r.exit_code != 0 or not (version := r.stdout.strip()):
        raise _Fail(f"docker daemon on {host_name} ({host.docker_host or 'default socket'}) not answering: {_why(r)}")
    return version


def _gpus(host_name: str, host: Host, t: Transport) -> list[GpuFacts]:
    r = _run(t, ["nvidia-smi", "--query-gpu=index,name,memory.total,memory.used", "--format=csv,noheader,nounits"])
    if r.exit_code != 0:
        raise _Fail(f"{host_name} declares {host.gpus} GPU(s) but nvidia-smi failed: {_why(r)}")
    gpus = [GpuFacts(**dict(zip(GpuFacts.model_fields, (p.strip() for p in line.split(",")), strict=True)))
            for line in r.stdout.strip().splitlines()]
    if len(gpus) != host.gpus:
        raise _Fail(f"{host_name} declares {host.gpus} GPU(s), nvidia-smi lists {len(gpus)}")
    return gpus


def _disk(host_name: str, role: str, path: str, t: Transport, must_exist: bool, min_free: int) -> DiskFacts:
    """Free bytes where `path` lives; a folder that does not exist yet is measured at its nearest parent."""
    at = path
    while True:
        r = _run(t, ["df", "-B1", "--output=avail", at])
        if r.exit_code == 0:
            break
        if must_exist or at in ("/", ""):
            raise _Fail(f"{role} path {path} on {host_name}: {_why(r, 'df failed')}")
        at = posixpath.dirname(at.rstrip("/")) or "/"
    avail = int(r.stdout.split()[-1])
    if avail < min_free:
        raise _Fail(f"{role} path {path} on {host_name} has {avail / 2**20:.0f} MiB free, "
                    f"less than the {min_free / 2**20:.0f} MiB a run needs")
    return DiskFacts(role=role, path=path, measured_at=at, avail_bytes=avail)


def _file(host_name: str, host: Host, t: Transport, ref: FileRef, base_dir: Path | None,
          cache: Sha256Cache) -> FileFacts:
    path = host_path(host, ref.path, base_dir)
    r = _run(t, ["stat", "-L", "-c", "%s %Y %F", path])
    if r.exit_code != 0:
        raise _Fail(f"model file {path} is missing on {host_name}")
    size_s, mtime_s, kind = r.stdout.strip().split(" ", 2)
    if not kind.startswith("regular"):
        raise _Fail(f"model file {path} on {host_name} is a {kind}, not a file")
    facts = FileFacts(path=path, bytes=int(size_s), mtime=int(mtime_s))
    if ref.bytes is not None and facts.bytes != ref.bytes:
        raise _Fail(f"model file {path} on {host_name} has {facts.bytes} bytes, the lane declares {ref.bytes}")
    if ref.sha256 is not None:
        key = f"{host_name}|{host.address}|{path}"
        digest = cache.get(key, facts.bytes, facts.mtime)
        facts.sha256_cached = digest is not None
        if digest is None:
            # about 1 GB/s; a deadline for the largest checkpoints, not for a stuck disk
            h = _run(t, ["sha256sum", "--", path], deadline_s=max(120.0, facts.bytes / 50e6))
            if h.exit_code != 0 or not h.stdout.strip():
                raise _Fail(f"sha256sum of {path} on {host_name} failed: {h.stderr.strip()[-200:]}")
            digest = h.stdout.split()[0]
            cache.put(key, facts.bytes, facts.mtime, digest)
        facts.sha256 = digest
        if digest != ref.sha256:
            raise _Fail(f"model file {path} on {host_name} has sha256 {digest[:12]}..., the lane declares {ref.sha256[:12]}...")
    return facts


class _Fail(Exception):
    """A failed check: its message is the lane's skip reason."""


def check_host(host_name: str, host: Host, transport: Transport, model_files: Sequence[FileRef],
               needs_docker: bool, *, base_dir: Path | None = None, cache_path: Path | None = None,
               min_free_bytes: int = MIN_FREE_BYTES) -> HostCheck:
    """Every host precondition of a lane, in order; the first failure is the reason (facts so far kept)."""
    check = HostCheck(host=host_name, ok=False)
    try:
        r = _run(transport, ["true"], deadline_s=host.connect_timeout_s + 10)
        check.reachable = r.exit_code == 0
        if not check.reachable:
            raise _Fail(f"host {host_name} ({host.address}) answers but `true` exited {r.exit_code}")
        if needs_docker:
            check.docker_server = _docker(host_name, host, transport)
        if host.gpus > 0:
            check.gpus = _gpus(host_name, host, transport)
        models = host_folder(host, host.paths.models, base_dir)
        check.disks.append(_disk(host_name, "models", models, transport, must_exist=True, min_free=0))
        artifacts = host_folder(host, host.paths.artifacts, base_dir)
        check.disks.append(_disk(host_name, "artifacts", artifacts, transport, must_exist=False, min_free=min_free_bytes))
        cache = Sha256Cache(cache_path)
        for ref in model_files:
            check.files.append(_file(host_name, host, transport, ref, base_dir, cache))
    except _Fail as e:
        check.reason = str(e)
        return check
    except TransportError as e:
        check.reason = f"host {host_name} ({host.address}:{host.port}) unreachable: {e}"
        return check
    check.ok = True
    return check
