"""Private docker daemons and a private image registry, started for the lab and the tests.

Each daemon has its own state folder (socket, data, exec root, config, log): never the system
docker, `/etc/docker/daemon.json` or a hub. In a network namespace when asked, via `nsenter`,
which execs (the pid we hold is the daemon's) and leaves mounts in the root namespace.

`stop()` leaves nothing behind: containers first (a dockerd killed under a running container
leaves its shim and engine running), then the daemon, then every process naming the state
folder (containerd, shims) with its descendants, then mounts under the folder.
"""

from __future__ import annotations

import ipaddress
import json
import os
import subprocess
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from lab import procs
from tasks.hosts.retry import retrying

_NETNS_CHARS = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_.-")
# sun_path is 108 bytes; containerd adds ".ttrpc" to its socket under the exec root.
_MAX_SOCKET_PATH = 100


class DaemonError(RuntimeError):
    """A daemon did not start or did not answer; the message carries its log tail."""


def _log_tail(path: Path, lines: int = 20) -> str:
    text = path.read_text(errors="replace") if path.exists() else ""
    return "\n".join(text.splitlines()[-lines:])


def netns_prefix(netns: str | None) -> list[str]:
    """Enter only the network namespace. Not `ip netns exec`: it also unshares the mount
    namespace and remounts /sys, which hides /sys/fs/cgroup ("Devices cgroup isn't mounted")."""
    if netns is None:
        return []
    if not netns or not set(netns) <= _NETNS_CHARS or len(netns) > 64 or netns in (".", ".."):
        raise ValueError(f"network namespace name {netns!r} must be letters, digits, '_', '.', '-'")
    if not (Path("/run/netns") / netns).exists():
        raise ValueError(f"network namespace {netns!r} does not exist (no /run/netns/{netns})")
    return ["nsenter", f"--net=/run/netns/{netns}", "--"]


def _pids_naming(folder: Path) -> set[int]:
    """Processes whose command line names `folder` (our daemon, its containerd, the shims)."""
    needle = str(folder).encode() + b"/"
    return procs.matching(lambda _, line: needle in line, skip={os.getpid()})


@dataclass
class Daemon:
    """A daemon we started: stopping it is idempotent and leaves no process or mount behind."""

    name: str
    state_dir: Path
    log_path: Path
    _proc: subprocess.Popen = field(repr=False, compare=False, kw_only=True)
    _stopped: bool = field(default=False, repr=False, compare=False, kw_only=True)

    @property
    def pid(self) -> int:
        return self._proc.pid

    def _before_stop(self) -> None:
        """What must go before the daemon itself (a dockerd's containers)."""

    def stop(self, grace_s: float = 20.0) -> None:
        if self._stopped:
            return
        try:
            if self._proc.poll() is None:
                self._before_stop()
        finally:
            self._kill(grace_s)
            self._stopped = True

    def _kill(self, grace_s: float) -> None:
        if self._proc.poll() is None:  # polled first: a reaped daemon's pid may be another process's now
            procs.kill_all({self.pid}, term_grace_s=grace_s, kill_grace_s=10.0)
            self._proc.wait(timeout=10)
        # containerd, shims and what runs under them outlive a dockerd that was killed.
        roots = _pids_naming(self.state_dir)
        if leftovers := roots | set(procs.descendants(roots)):
            procs.kill_all(leftovers, term_grace_s=5.0, kill_grace_s=5.0)
        procs.unmount_under(self.state_dir)


def spawn(argv: list[str], log_path: Path, env: dict[str, str] | None = None) -> subprocess.Popen:
    """A daemon in its own session, its output appended to `log_path`."""
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with log_path.open("ab") as log:
        return subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                start_new_session=True, env=env)


def _wait(daemon: Daemon, probe, what: str, deadline_s: float) -> None:
    def answer() -> str | None:
        """None once `probe` answers, else what failed; the daemon's exit ends the wait."""
        if (code := daemon._proc.poll()) is not None:
            daemon.stop()
            raise DaemonError(f"{daemon.name} exited with code {code} before {what} answered; "
                              f"last log lines:\n{_log_tail(daemon.log_path)}")
        try:
            return None if probe() else "no answer yet"
        except Exception as e:  # noqa: BLE001 - any failure is 'not up yet' until the deadline
            return f"{type(e).__name__}: {e}"

    last = retrying(within_s=deadline_s, wait_s=0.2, until=lambda seen: seen is None)(answer)
    if last is not None:
        daemon.stop()
        raise DaemonError(f"{daemon.name}: {what} did not answer within {deadline_s:.0f}s ({last}); "
                          f"last log lines:\n{_log_tail(daemon.log_path)}")


@dataclass
class Dockerd(Daemon):
    socket: Path

    @property
    def docker_host(self) -> str:
        return f"unix://{self.socket}"

    def docker(self, *args: str, timeout: float = 60.0) -> subprocess.CompletedProcess:
        return docker(self.docker_host, *args, timeout=timeout)

    def _before_stop(self) -> None:
        remove_containers(self.docker_host)


def docker(docker_host: str, *args: str, timeout: float = 60.0, env: dict[str, str] | None = None
           ) -> subprocess.CompletedProcess:
    """The docker CLI against the daemon at `docker_host` (the lab's and the tests' daemons)."""
    return subprocess.run(["docker", "--host", docker_host, *args], capture_output=True, text=True,
                          timeout=timeout, env=env, check=False)


def remove_containers(docker_host: str) -> list[str]:
    """Remove every container of the daemon at `docker_host`; returns their ids ([] when it does not answer)."""
    try:
        if ids := docker(docker_host, "ps", "-aq", timeout=30).stdout.split():
            docker(docker_host, "rm", "-f", *ids, timeout=120)
    except (OSError, subprocess.TimeoutExpired):
        return []
    return ids


def start_dockerd(state_dir: Path, netns: str | None = None, insecure_registries: Sequence[str] = (),
                  deadline_s: float = 60.0) -> Dockerd:
    """A dockerd of our own under `state_dir`: no iptables, no bridge (containers use the host
    network of the namespace it runs in), its own config file (never /etc/docker/daemon.json)."""
    state_dir = Path(state_dir).resolve()
    exec_root, data_root, sock = state_dir / "exec", state_dir / "root", state_dir / "docker.sock"
    if len(str(exec_root / "containerd" / "containerd.sock.ttrpc")) > _MAX_SOCKET_PATH:
        raise ValueError(f"state folder {state_dir} is too long for unix socket paths; use a shorter one")
    for registry in insecure_registries:
        if not all(c.isalnum() or c in ".:-[]/" for c in registry):
            raise ValueError(f"insecure registry {registry!r} must be host:port")
    state_dir.mkdir(parents=True, exist_ok=True)
    config = state_dir / "daemon.json"
    config.write_text(json.dumps({"insecure-registries": list(insecure_registries)}))
    log_path = state_dir / "dockerd.log"
    argv = [*netns_prefix(netns), "dockerd", "--config-file", str(config), "--host", f"unix://{sock}",
            "--data-root", str(data_root), "--exec-root", str(exec_root), "--pidfile", str(state_dir / "docker.pid"),
            "--iptables=false", "--ip6tables=false", "--bridge=none"]
    proc = spawn(argv, log_path)
    daemon = Dockerd(name=f"dockerd[{state_dir.name}]", state_dir=state_dir, log_path=log_path, _proc=proc, socket=sock)

    def ping() -> bool:
        with httpx.Client(transport=httpx.HTTPTransport(uds=str(sock)), timeout=2.0) as client:
            return client.get("http://docker/_ping").text == "OK"

    _wait(daemon, ping, f"docker _ping on {sock}", deadline_s)
    return daemon


@dataclass
class Registry(Daemon):
    address: str
    port: int

    @property
    def url(self) -> str:
        host = f"[{self.address}]" if ":" in self.address else self.address
        return f"{host}:{self.port}"


def start_registry(state_dir: Path, address: str = "127.0.0.1", port: int = 5000,
                   deadline_s: float = 30.0) -> Registry:
    """Debian's distribution registry (`docker-registry serve`), filesystem storage under
    `state_dir`, plain HTTP on `address:port` only, no auth (loopback or the lab network)."""
    ipaddress.ip_address(address)  # ValueError on anything that is not an IP address
    if not 1 <= int(port) <= 65535:
        raise ValueError(f"port {port} out of range")
    state_dir = Path(state_dir).resolve()
    state_dir.mkdir(parents=True, exist_ok=True)
    host = f"[{address}]" if ":" in address else address
    config = state_dir / "registry.yml"
    config.write_text(json.dumps({  # JSON is YAML
        "version": 0.1,
        "storage": {"filesystem": {"rootdirectory": str(state_dir / "data")}, "delete": {"enabled": True}},
        "http": {"addr": f"{host}:{port}", "headers": {"X-Content-Type-Options": ["nosniff"]}},
    }))
    log_path = state_dir / "registry.log"
    env = {k: v for k, v in os.environ.items() if not k.startswith("REGISTRY_")}  # no overrides from outside
    proc = spawn(["/usr/bin/docker-registry", "serve", str(config)], log_path, env=env)
    daemon = Registry(name=f"registry[{state_dir.name}]", state_dir=state_dir, log_path=log_path, _proc=proc,
                      address=address, port=port)
    url = f"http://{daemon.url}/v2/"
    _wait(daemon, lambda: httpx.get(url, timeout=2.0).status_code == 200, f"registry GET {url}", deadline_s)
    return daemon
