"""How lanebench runs a command on a host: here (`local`) or over SSH (`ssh`, paramiko).

Every stage that touches a host goes through a `Transport`, so preflight, image pull, boot and
teardown read the same for this machine and a GB300 across the room. The contract:
- `run` executes an argv (never a shell string; `shlex.join`ed for a remote shell) with a
  wall-clock deadline. A non-zero exit code is a result, not an exception.
- `env` never reaches a command line, which every user sees (`ps`, /proc/PID/cmdline, sshd's
  logs) while env carries secrets (`HF_TOKEN`): locally the process's environment; over SSH
  sent on stdin and exported by the remote wrapper.
- Connection faults (refused, reset, dropped, keepalive) raise `TransportError`; `run` retries
  them only for a command declared idempotent, never silently re-running another.
- An unknown or changed host key raises `HostKeyError` (never retried), saying how to trust the
  host; trust-on-first-use only when the host opts in.
- `spawn` starts a server in its own session, its output streamed into a local log, and returns
  a handle to poll and stop it. The pid goes into a pidfile named after the lane, so a crashed
  run's leftover is found and stopped before the next boot.
"""

from __future__ import annotations

import atexit
import codecs
import os
import re
import signal
import subprocess
import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Callable
from contextlib import suppress
from pathlib import Path
from typing import IO, TYPE_CHECKING

from pydantic import BaseModel

from tasks.hosts.owner import Owner
from tasks.hosts.retry import retrying
from tasks.inventory.paths import resolve

if TYPE_CHECKING:
    from tasks.hosts.listener import Listeners

OutputCallback = Callable[[str], None]

# Where a spawn records its process group, on the host it runs on: `stop_leftover(name)` finds a
# crashed run's server there before the next boot. Fixed under $HOME so a new login finds it.
PIDFILE_DIR = "~/.cache/lanebench/run"
_SPAWN_NAME = re.compile(r"^[A-Za-z0-9_.-]+$")
_ENV_KEY = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


class CommandResult(BaseModel):
    argv: list[str]
    exit_code: int
    stdout: str
    stderr: str
    seconds: float
    attempts: int = 1


class TransportError(RuntimeError):
    """The host could not be reached or the connection dropped (the command's fate unknown)."""


class HostKeyError(TransportError):
    """The host's key is unknown or changed: refused, never retried; says how to trust it."""


class CommandTimeout(TransportError):
    """The command outlived its wall-clock deadline (it was stopped)."""


class Spawned(ABC):
    """A long-running process started by `Transport.spawn`."""

    pid: int
    argv: list[str]
    transport: Transport  # where it runs

    @abstractmethod
    def poll(self) -> int | None:
        """Exit code once it has ended, else None."""

    @abstractmethod
    def stop(self, grace_s: float = 10.0) -> None:
        """SIGTERM the process group, SIGKILL after `grace_s`; idempotent."""

    def listeners(self, port: int) -> Listeners | None:
        """Who listens on `port` where this process runs; None when it cannot be asked there."""
        from tasks.hosts.listener import listeners

        return listeners(self.transport, port)

    def owns(self, found: Listeners) -> bool:
        """A listener's owners include this spawn's process group (its pid), wrapper or not."""
        return any(o.pgid == self.pid for o in found.owners)


class Transport(ABC):
    host_name: str

    @abstractmethod
    def run(self, argv: list[str], *, deadline_s: float = 60.0, idempotent: bool = False,
            stdin: bytes | None = None, on_output: OutputCallback | None = None,
            env: dict[str, str] | None = None) -> CommandResult:
        """Run argv within the deadline; `on_output` sees stdout/stderr text as it comes."""

    @abstractmethod
    def spawn(self, argv: list[str], log_path: Path, *, name: str, env: dict[str, str] | None = None) -> Spawned:
        """Start argv in the background, output streamed into the local `log_path`."""

    @abstractmethod
    def stop_leftover(self, name: str, grace_s: float = 5.0) -> bool:
        """Stop the group a crashed run recorded in spawn `name`'s pidfile; True when it was running."""

    def close(self) -> None:  # noqa: B027 - nothing to close for local
        """Release connections."""


def check_spawn_name(name: str) -> str:
    """Spawn names become file names on the host: letters, digits, '_', '.', '-' only."""
    if not _SPAWN_NAME.fullmatch(name) or name in (".", ".."):
        raise ValueError(f"spawn name {name!r} must be letters, digits, '_', '.', '-'")
    return name


def check_env(env: dict[str, str] | None) -> dict[str, str]:
    """Names plain identifiers; values anything but newline (one `NAME=value` line each over SSH) or NUL."""
    env = dict(env or {})
    for key, value in env.items():
        if not _ENV_KEY.fullmatch(key):
            raise ValueError(f"environment variable name {key!r} is not a valid identifier")
        if "\n" in value or "\0" in value:
            raise ValueError(f"environment variable {key}: its value holds a newline or NUL, which an "
                             "environment cannot carry safely")
    return env


class StreamText:
    """Incremental UTF-8 decoding of one output stream (a chunk may split a character)."""

    def __init__(self, on_output: OutputCallback | None = None) -> None:
        self.parts: list[str] = []
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._on_output = on_output

    def feed(self, data: bytes, final: bool = False) -> None:
        text = self._decoder.decode(data, final)
        if text:
            self.parts.append(text)
            if self._on_output is not None:
                self._on_output(text)

    @property
    def text(self) -> str:
        return "".join(self.parts)


# ---------------------------------------------------------------------------------------------
# local: subprocesses on this machine

# Our running process groups, each with its pidfile (None for a `run`): none outlives this process.
_LIVE: dict[int, Path | None] = {}


def _killpg(pgid: int, sig: int = signal.SIGKILL) -> None:
    with suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, sig)


def _pidfile_pgid(pidfile: Path) -> int | None:
    """The process group a local pidfile names (its first line), None when unreadable."""
    try:
        return int(pidfile.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return None


def _pidfile_owner_alive(pidfile: Path) -> bool:
    """The lanebench that spawned the group (the pidfile's second line) still runs here. Orchestrators
    with separate Prefect homes share no host lock, so a live owner's server is never reclaimed
    (preflight then skips the lane: port taken). An older or unreadable pidfile: the lock alone judges."""
    try:
        return Owner.model_validate_json(pidfile.read_text().splitlines()[1]).alive() is True
    except (OSError, IndexError, ValueError):
        return False


def _unrecord(pgid: int) -> None:
    """Forget the group; remove its pidfile while it still names it (a newer spawn may own the name)."""
    pidfile = _LIVE.pop(pgid, None)
    if pidfile is not None and _pidfile_pgid(pidfile) == pgid:
        with suppress(OSError):
            pidfile.unlink()


@atexit.register
def _kill_live() -> None:
    """No local process group, nor a pidfile naming one, outlives a crashed or Ctrl-C'd run (issue 27)."""
    for pgid in list(_LIVE):
        _killpg(pgid)
        _unrecord(pgid)


def _pump(stream: IO[bytes], sink: StreamText) -> None:
    while chunk := stream.read1(65536):  # type: ignore[attr-defined]
        sink.feed(chunk)
    sink.feed(b"", final=True)


def _feed_stdin(stream: IO[bytes], data: bytes) -> None:
    with suppress(OSError):
        stream.write(data)
        stream.close()


def _group_alive(pgid: int) -> bool:
    with suppress(ChildProcessError):
        os.waitpid(pgid, os.WNOHANG)  # reap our own zombie leader, or a zombie counts as alive
    try:
        os.killpg(pgid, 0)
        return True
    except ProcessLookupError:
        return False
    except PermissionError:
        return True


def _stop_group(pgid: int, grace_s: float, running: Callable[[int], bool] = _group_alive) -> None:
    """SIGTERM a process group, SIGKILL it after `grace_s` while it is still `running`."""
    _killpg(pgid, signal.SIGTERM)
    _killpg(pgid, signal.SIGCONT)  # a stopped (SIGSTOP) process acts on SIGTERM only once continued
    if retrying(within_s=grace_s, wait_s=0.05, until=lambda alive: not alive)(running, pgid):
        _killpg(pgid, signal.SIGKILL)


def local_pidfile(name: str) -> Path:
    return Path(PIDFILE_DIR).expanduser() / f"{check_spawn_name(name)}.pid"


class LocalSpawned(Spawned):
    def __init__(self, proc: subprocess.Popen, argv: list[str], transport: Transport) -> None:
        self.proc, self.pid, self.argv, self.transport = proc, proc.pid, argv, transport

    def poll(self) -> int | None:
        return self.proc.poll()

    def stop(self, grace_s: float = 10.0) -> None:
        if self.proc.poll() is None:
            _stop_group(self.pid, grace_s, lambda _: self.proc.poll() is None)
            self.proc.wait(timeout=10)
        _killpg(self.pid)  # children that outlived the leader
        _unrecord(self.pid)


class LocalTransport(Transport):
    """Commands as subprocesses of this machine, each in its own session/process group."""

    def __init__(self, host_name: str = "local") -> None:
        self.host_name = host_name

    def run(self, argv: list[str], *, deadline_s: float = 60.0, idempotent: bool = False,
            stdin: bytes | None = None, on_output: OutputCallback | None = None,
            env: dict[str, str] | None = None) -> CommandResult:
        t0 = time.monotonic()
        full_env = {**os.environ, **check_env(env)} if env else None
        try:
            proc = subprocess.Popen(argv, stdin=subprocess.PIPE if stdin is not None else subprocess.DEVNULL,
                                    stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True,
                                    env=full_env)
        except OSError as e:
            # What a remote shell reports for the same mistake: 127 not found, 126 not executable.
            code = 127 if isinstance(e, FileNotFoundError) else 126
            return CommandResult(argv=argv, exit_code=code, stdout="", stderr=f"{argv[0]}: {e.strerror}\n",
                                 seconds=time.monotonic() - t0)
        _LIVE[proc.pid] = None
        out, err = StreamText(on_output), StreamText(on_output)
        threads = [threading.Thread(target=_pump, args=(proc.stdout, out), daemon=True),
                   threading.Thread(target=_pump, args=(proc.stderr, err), daemon=True)]
        if stdin is not None:
            threads.append(threading.Thread(target=_feed_stdin, args=(proc.stdin, stdin), daemon=True))
        for t in threads:
            t.start()
        try:
            proc.wait(timeout=deadline_s)
        except subprocess.TimeoutExpired:
            _killpg(proc.pid)
            proc.wait()
            raise CommandTimeout(f"{self.host_name}: {argv[0]} still running after its {deadline_s:g} s deadline; "
                                 "its process group was killed") from None
        finally:
            _LIVE.pop(proc.pid, None)
        for t in threads:  # a background child holding the pipes must not hold us past the deadline
            t.join(timeout=max(0.5, deadline_s - (time.monotonic() - t0)))
        return CommandResult(argv=argv, exit_code=proc.returncode, stdout=out.text, stderr=err.text,
                             seconds=time.monotonic() - t0)

    def spawn(self, argv: list[str], log_path: Path, *, name: str, env: dict[str, str] | None = None) -> Spawned:
        pidfile = local_pidfile(name)
        full_env = {**os.environ, **check_env(env)}
        log_path.parent.mkdir(parents=True, exist_ok=True)
        with log_path.open("ab") as log:
            proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                    env=full_env, start_new_session=True)
        _LIVE[proc.pid] = pidfile
        pidfile.parent.mkdir(parents=True, exist_ok=True)
        pidfile.write_text(f"{proc.pid}\n{Owner.here().model_dump_json()}\n")  # pgid, then who spawned it
        return LocalSpawned(proc, argv, self)

    def stop_leftover(self, name: str, grace_s: float = 5.0) -> bool:
        pidfile = local_pidfile(name)
        if (pgid := _pidfile_pgid(pidfile)) is None:
            pidfile.unlink(missing_ok=True)
            return False
        if _pidfile_owner_alive(pidfile):
            return False  # another live lanebench's server: not a leftover
        running = pgid > 1 and _group_alive(pgid)
        if running:
            _stop_group(pgid, grace_s)
            _LIVE.pop(pgid, None)
        pidfile.unlink(missing_ok=True)
        return running


def resolve_path(value: str | None, default: str, base_dir: Path) -> Path:
    """A config path: `~` expanded, relative to the inventory's folder."""
    return resolve(Path(base_dir), value if value is not None else default)
