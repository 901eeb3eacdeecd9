"""A real OpenSSH server for the lab and the transport tests: no mocks of the thing we talk to.

Its own config and host key in a state folder (never /etc/ssh), one address:port, optionally in a
network namespace. `Sshd.stop` kills the server and every session process it forked (each
connection has its own session: killing the server's process group would leak them).
"""

from __future__ import annotations

import signal
import subprocess
import sys
from dataclasses import dataclass, field
from contextlib import suppress
from pathlib import Path

from lab import procs
from lab.docker import netns_prefix, spawn
from tasks.hosts.retry import retrying
from tasks.hosts.ssh import host_key_name

SSHD = "/usr/sbin/sshd"


@dataclass
class Sshd:
    address: str
    port: int
    state_dir: Path
    host_key_line: str  # "ssh-ed25519 AAAA..." of the server's host key
    _proc: subprocess.Popen = field(repr=False)

    @property
    def pid(self) -> int:
        return self._proc.pid

    def known_hosts_line(self) -> str:
        return f"{host_key_name(self.address, self.port)} {self.host_key_line}"

    def log(self) -> str:
        path = self.state_dir / "sshd.log"
        return path.read_text(errors="replace") if path.exists() else ""

    def stop(self) -> None:
        """Kill the server and all its descendants, and wait; idempotent."""
        victims = [*procs.descendants([self.pid]), self.pid] if self._proc.poll() is None else []
        procs.signal_all(victims, signal.SIGKILL)
        with suppress(subprocess.TimeoutExpired):
            self._proc.wait(timeout=10)
        (self.state_dir / "sshd.pid").unlink(missing_ok=True)


def make_keypair(path: Path, comment: str = "lanebench") -> str:
    """An ed25519 key pair without passphrase at `path` (reused if present); returns the public key line."""
    path = Path(path)
    pub = path.with_name(path.name + ".pub")
    if not (path.exists() and pub.exists()):
        path.parent.mkdir(parents=True, exist_ok=True)
        path.unlink(missing_ok=True)
        pub.unlink(missing_ok=True)
        subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", comment, "-f", str(path)],
                       check=True, capture_output=True, timeout=30)
    return pub.read_text().strip()


def start_sshd(state_dir: Path, address: str, port: int, authorized_keys: Path, netns: str | None = None) -> Sshd:
    """Start `/usr/sbin/sshd -D -e` on address:port (inside `netns` if given); returns once the port accepts."""
    state_dir = Path(state_dir).resolve()
    state_dir.mkdir(parents=True, exist_ok=True)
    Path("/run/sshd").mkdir(mode=0o755, parents=True, exist_ok=True)  # sshd's privilege-separation dir
    host_key = state_dir / "ssh_host_ed25519_key"
    host_pub = make_keypair(host_key, comment=f"lanebench-sshd-{address}-{port}")
    listen = f"[{address}]:{port}" if ":" in address else f"{address}:{port}"
    config = state_dir / "sshd_config"
    config.write_text("\n".join([
        f"ListenAddress {listen}",
        f"HostKey {host_key}",
        f"PidFile {state_dir / 'sshd.pid'}",
        f"AuthorizedKeysFile {Path(authorized_keys).resolve()}",
        "PasswordAuthentication no",
        "KbdInteractiveAuthentication no",
        "UsePAM no",
        "StrictModes no",
        "PrintMotd no",
        "MaxSessions 32",
        "MaxStartups 32:30:64",
        "Subsystem sftp internal-sftp",
        "",
    ]))
    argv = [SSHD, "-D", "-e", "-f", str(config)]
    if netns is not None:
        argv = ["ip", "netns", "exec", netns, *argv]  # `ip netns exec` execs: the pid is sshd's own
    (state_dir / "sshd.pid").unlink(missing_ok=True)
    proc = spawn(argv, state_dir / "sshd.log")
    sshd = Sshd(address=address, port=port, state_dir=state_dir, host_key_line=" ".join(host_pub.split()[:2]), _proc=proc)
    probe = [*netns_prefix(netns), sys.executable, "-c",
             f"import socket; socket.create_connection(({address!r}, {port}), timeout=1.0).close()"]

    def accepts() -> bool:
        if proc.poll() is not None:
            raise RuntimeError(f"sshd on {listen} exited with code {proc.returncode}:\n{sshd.log()[-3000:]}")
        return subprocess.run(probe, capture_output=True, timeout=10).returncode == 0

    if retrying(within_s=10.0, wait_s=0.1, until=bool)(accepts):
        return sshd
    sshd.stop()
    raise RuntimeError(f"sshd on {listen} did not accept connections within 10 s:\n{sshd.log()[-3000:]}")


def kill_sessions(pid: int, *also: int) -> int:
    """SIGKILL the sshd processes serving connections below listener `pid` (and `also`); returns how many."""
    victims = [p for p in procs.descendants([pid]) if _comm(p) in ("sshd", "sshd-session")]
    procs.signal_all([*also, *victims], signal.SIGKILL)
    return len(victims)


def _comm(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return ""
