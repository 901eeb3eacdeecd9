"""Container lanes: pull the engine image by digest, run it, stream its logs, tear it down.

The docker CLI over our `Transport`, not docker-py over SSH: docker-py's `ssh://` opens its own
paramiko client (system known_hosts, its own timeouts and retries). The transport keeps one
host-key policy, one deadline/retry policy (only idempotent commands retried) and one audit
trail of argv commands, the same for a local daemon; `--host` when the host names a daemon.

- pull: a tag can move, so a lane pins `repo@sha256:...`, which must be in the pulled image's
  RepoDigests. A registry that does not answer is one clear `ImageError` with docker's message.
- run: `--pull never` (nothing fetched behind our back), host network (the bench reaches the
  server on the host's address), model folders read-only, a `lanebench.lane` label marking a
  leftover as ours. Env goes as `-e NAME`, the value from the docker CLI's environment: a
  `-e NAME=value` would show an `HF_TOKEN` to `ps` on the host.
- teardown: `docker stop -t grace`, then `docker rm -f`, idempotent; a crashed run's container
  under the lane's name is removed before the next boot (`remove_leftover`).
"""

from __future__ import annotations

import json
import math
import re
import time
from dataclasses import dataclass
from pathlib import Path

from pydantic import BaseModel

from tasks.inventory.models import _NAME, _SAFE_FLAG, ContainerSettings
from tasks.hosts.transport import CommandResult, CommandTimeout, Spawned, Transport
from tasks.hosts.listener import Listeners, listeners
from tasks.hosts.retry import retrying

PINNED = re.compile(r"^(?P<repo>[a-z0-9._/:-]+)@(?P<digest>sha256:[0-9a-f]{64})$")
_DOCKER_HOST = re.compile(r"^(unix|tcp)://[A-Za-z0-9_./:-]+$")
_MOUNT = re.compile(r"^/[A-Za-z0-9_./-]*:/[A-Za-z0-9_./-]*(:ro|:rw)?$")
_ENV_KEY = re.compile(r"^[A-Z_][A-Z0-9_]*$")
# What docker says when it could not reach the registry at all (as opposed to "no such manifest").
_UNREACHABLE = re.compile(r"connection refused|dial tcp|no such host|i/o timeout|no route to host|network is unreachable|"
                          r"connection reset|TLS handshake timeout|\bEOF\b",
                          re.IGNORECASE)
LANE_LABEL = "lanebench.lane"


class ImageError(RuntimeError):
    """The pinned image could not be had or is not what was pinned."""


class ContainerError(RuntimeError):
    """A container could not be started, inspected or removed; carries docker's message."""


class DockerUnavailable(ContainerError):
    """The docker daemon on the host did not answer."""


class ImageFacts(BaseModel):
    reference: str  # the pinned reference, repo@sha256:...
    digest: str  # sha256:...
    image_id: str
    pulled: bool  # False when the host already had it
    repo_digests: list[str]
    seconds: float


def container_name(lane: str) -> str:
    if not _NAME.fullmatch(lane):
        raise ValueError(f"lane name {lane!r} must be letters, digits, '_', '.', '-' (at most 63)")
    return f"lanebench-{lane}"


def registry_of(repo: str) -> str:
    """The registry part of a repository name (docker's rule: a first component with '.' or ':')."""
    first = repo.split("/", 1)[0]
    return first if "/" in repo and ("." in first or ":" in first or first == "localhost") else "docker.io"


def _docker_argv(docker_host: str | None, *args: str) -> list[str]:
    if docker_host is None:
        return ["docker", *args]
    if not _DOCKER_HOST.fullmatch(docker_host):
        raise ValueError(f"docker host {docker_host!r} must be unix://PATH or tcp://HOST:PORT")
    return ["docker", "--host", docker_host, *args]


def _docker(transport: Transport, docker_host: str | None, *args: str, deadline_s: float = 60.0,
            idempotent: bool = True, env: dict[str, str] | None = None) -> CommandResult:
    r = transport.run(_docker_argv(docker_host, *args), deadline_s=deadline_s, idempotent=idempotent, env=env)
    if r.exit_code != 0 and ("Cannot connect to the Docker daemon" in r.stderr or "docker: not found" in r.stderr
                             or r.exit_code == 127):
        where = docker_host or "the default docker host"
        raise DockerUnavailable(f"{transport.host_name}: docker daemon at {where} did not answer: {r.stderr.strip()}")
    return r


def _message(r: CommandResult) -> str:
    return (r.stderr.strip() or r.stdout.strip())[-1500:]


def _gone_or_ok(r: CommandResult, what: str) -> CommandResult:
    """`r`, unless docker failed for another reason than the container being gone already."""
    if r.exit_code != 0 and "No such" not in r.stderr:
        raise ContainerError(f"{what} failed: {_message(r)}")
    return r


def _pinned(image_ref: str) -> re.Match[str]:
    if not (m := PINNED.fullmatch(image_ref)):
        raise ValueError(f"image {image_ref!r} is not pinned as repo@sha256:<64 hex>")
    return m


def verify_repo_digests(image_ref: str, repo_digests: list[str]) -> None:
    """The pinned `repo@sha256:...` must be among the local image's RepoDigests."""
    m = _pinned(image_ref)
    if image_ref not in repo_digests:
        found = [d.split("@", 1)[1] for d in repo_digests if d.split("@", 1)[0] == m["repo"]]
        raise ImageError(f"image {m['repo']}: pinned digest {m['digest']} but the local image has "
                         f"{found or 'no digest for this repository'} (RepoDigests: {repo_digests})")


def _inspect_image(transport: Transport, docker_host: str | None, image_ref: str) -> dict | None:
    r = _docker(transport, docker_host, "image", "inspect", "--format", "{{json .}}", image_ref, deadline_s=60)
    if r.exit_code != 0:
        if "No such image" in r.stderr or "No such object" in r.stderr:
            return None
        raise ImageError(f"docker image inspect {image_ref} failed: {_message(r)}")
    return json.loads(r.stdout)


def pull_by_digest(transport: Transport, docker_host: str | None, image_ref: str,
                   deadline_s: float = 1800.0) -> ImageFacts:
    """Have the pinned image on the host (pulled only when missing), verified by digest."""
    m = _pinned(image_ref)
    registry = registry_of(m["repo"])
    t0 = time.monotonic()
    info = _inspect_image(transport, docker_host, image_ref)
    pulled = info is None
    if info is None:
        try:
            r = _docker(transport, docker_host, "pull", image_ref, deadline_s=deadline_s, idempotent=True)
        except CommandTimeout as e:
            raise ImageError(f"pull of {image_ref} from registry {registry} did not finish within "
                             f"{deadline_s:g} s: {e}") from e
        if r.exit_code != 0:
            msg = _message(r)
            if "server gave HTTP response to HTTPS client" in msg:
                raise ImageError(f"registry {registry} speaks plain HTTP: add it to the daemon's insecure "
                                 f"registries on {transport.host_name}: {msg}")
            if _UNREACHABLE.search(msg):
                raise ImageError(f"registry {registry} did not answer: {msg}")
            raise ImageError(f"registry {registry} would not give {image_ref}: {msg}")
        info = _inspect_image(transport, docker_host, image_ref)
        if info is None:
            raise ImageError(f"docker pull {image_ref} succeeded but the image is not on the host")
    repo_digests = list(info.get("RepoDigests") or [])
    verify_repo_digests(image_ref, repo_digests)
    return ImageFacts(reference=image_ref, digest=m["digest"], image_id=info["Id"], pulled=pulled,
                      repo_digests=repo_digests, seconds=time.monotonic() - t0)


def remove_leftover(transport: Transport, docker_host: str | None, name: str) -> bool:
    """Remove the container (and log streamer) a crashed run left under lane `name`; True when there
    was one. One under that name that lanebench did not start is refused, not removed."""
    container = container_name(name)
    r = _docker(transport, docker_host, "container", "inspect", "--format",
                "{{json .Config.Labels}}", container, deadline_s=30)
    found = r.exit_code == 0
    if found:
        labels = json.loads(r.stdout) or {}
        if labels.get(LANE_LABEL) != name:
            raise ContainerError(f"{transport.host_name}: a container named {container} exists without the label "
                                 f"{LANE_LABEL}={name}: lanebench did not start it; remove or rename it yourself")
        _gone_or_ok(_docker(transport, docker_host, "rm", "-f", container, deadline_s=120),
                    f"{transport.host_name}: docker rm -f {container}")
    _gone_or_ok(r, f"{transport.host_name}: docker container inspect {container}")
    transport.stop_leftover(f"{container}-logs")
    return found


@dataclass(eq=False)
class ContainerHandle(Spawned):
    """A running engine container as a spawned process: `pid` the engine's on the host, `logs` the
    `docker logs --follow` streamer."""

    transport: Transport
    docker_host: str | None
    name: str
    container_id: str
    argv: list[str]
    pid: int
    logs: Spawned
    _exit_code: int | None = None
    _removed: bool = False

    def poll(self) -> int | None:
        """None while running; the exit code once it has ended (-1 if it vanished unseen)."""
        if self._exit_code is not None:
            return self._exit_code
        r = _gone_or_ok(_docker(self.transport, self.docker_host, "inspect", "--format",
                                "{{.State.Running}} {{.State.ExitCode}}", self.container_id, deadline_s=30),
                        f"docker inspect {self.name}")
        if r.exit_code != 0:
            self._exit_code = -1
        elif (state := r.stdout.split())[0] == "true":
            return None
        else:
            self._exit_code = int(state[1])
        return self._exit_code

    def listeners(self, port: int) -> Listeners | None:
        """Asked inside the container (host network: the host's sockets, the container's processes)."""
        return listeners(self.transport, port, prefix=_docker_argv(self.docker_host, "exec", self.container_id))

    def owns(self, found: Listeners) -> bool:
        return bool(found.owners)  # only the container's own processes are visible from inside it

    def stop(self, grace_s: float = 10.0) -> None:
        """`docker stop -t grace`, then `docker rm -f`, then the log streamer; idempotent."""
        if self._removed:
            return
        grace = max(0, math.ceil(grace_s))
        _gone_or_ok(_docker(self.transport, self.docker_host, "stop", "-t", str(grace), self.container_id,
                            deadline_s=grace + 60), f"docker stop {self.name}")
        self.poll()  # keep the exit code before the container is gone
        _gone_or_ok(_docker(self.transport, self.docker_host, "rm", "-f", self.container_id, deadline_s=120),
                    f"docker rm -f {self.name}")
        # `docker logs -f` ends by itself once the container stopped
        retrying(within_s=5.0, wait_s=0.1, until=lambda code: code is not None)(self.logs.poll)
        self.logs.stop(grace_s=2.0)
        self._removed = True


def run_container(transport: Transport, docker_host: str | None, name: str, image_ref: str, argv: list[str],
                  settings: ContainerSettings, gpus: int, mounts: list[str], env: dict[str, str],
                  log_path: Path, *, deadline_s: float = 120.0, entrypoint: str | None = None) -> ContainerHandle:
    """Start lane `name`'s engine container, logs streamed into `log_path`. `argv` follows the image's
    entrypoint or `entrypoint` (vLLM's image runs `vllm serve`, SGLang's none). The image must be on
    the host (`pull_by_digest`), a leftover gone (`remove_leftover`)."""
    container = container_name(name)
    _pinned(image_ref)
    for arg in argv:
        if not _SAFE_FLAG.fullmatch(arg):
            raise ValueError(f"engine argument {arg!r} has characters not allowed on a command line")
    volumes: list[str] = []
    for mount in [*mounts, *settings.mounts]:
        if not _MOUNT.fullmatch(mount):
            raise ValueError(f"mount {mount!r} must be /host/path:/container/path[:ro|:rw]")
        volumes += ["-v", mount if mount.endswith((":ro", ":rw")) else f"{mount}:ro"]
    env_args: list[str] = []
    for key, value in env.items():
        if not _ENV_KEY.fullmatch(key) or not _SAFE_FLAG.fullmatch(value):
            raise ValueError(f"environment {key}={value!r}: name must be A-Z, 0-9, '_' and the value plain")
        env_args += ["-e", key]  # the value from the docker CLI's environment, not its argv
    run_argv = ["run", "-d", "--name", container, "--pull", "never", "--network", "host",
                "--ipc", settings.ipc, "--shm-size", settings.shm_size,
                *(["--gpus", "all"] if gpus > 0 else []), *volumes, *env_args,
                *(["--entrypoint", entrypoint] if entrypoint else []),
                "--label", f"{LANE_LABEL}={name}", image_ref, *argv]
    try:
        r = _docker(transport, docker_host, *run_argv, deadline_s=deadline_s, idempotent=False, env=env)
    except CommandTimeout:
        _docker(transport, docker_host, "rm", "-f", container, deadline_s=60)  # it may have been created
        raise
    if r.exit_code != 0:
        msg = _message(r)
        hint = " (a leftover: remove_leftover first)" if "is already in use" in msg else ""
        raise ContainerError(f"{transport.host_name}: docker run for lane {name} failed{hint}: {msg}")
    container_id = r.stdout.strip().splitlines()[-1]
    info = _docker(transport, docker_host, "inspect", "--format", "{{.State.Pid}}", container_id, deadline_s=30)
    pid = int(info.stdout.strip() or 0) if info.exit_code == 0 else 0
    try:
        logs = transport.spawn(_docker_argv(docker_host, "logs", "--follow", container_id), log_path,
                               name=f"{container}-logs")
    except BaseException:
        _docker(transport, docker_host, "rm", "-f", container_id, deadline_s=60)  # no container without its log
        raise
    return ContainerHandle(transport, docker_host, name, container_id, _docker_argv(docker_host, *run_argv), pid, logs)
