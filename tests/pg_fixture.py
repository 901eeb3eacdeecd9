"""A real PostgreSQL cluster of the test's own: initdb + pg_ctl in a temp folder, on a loopback port.

Why a fixture rather than a service `.ci/run` starts: it needs only the distribution's package
(`./setup` installs `postgresql`), leaves nothing running after the session, cannot collide with
a PostgreSQL the machine already runs (own folder, own port from 18480-18499, own socket folder),
and works the same on a laptop. PostgreSQL refuses to run as root, so as root (CI) the cluster
runs as the package's `postgres` user; otherwise as the caller. Authentication is `trust` on
127.0.0.1 only: the cluster lives for one test session and listens nowhere else.
"""

from __future__ import annotations

import os
import pwd
import shutil
import socket
import subprocess
import tempfile
from collections.abc import Iterator
from glob import glob
from pathlib import Path

import pytest

PORTS = range(18480, 18500)


def pg_bin() -> Path:
    """The newest installed server's bin folder (Debian keeps them under /usr/lib/postgresql/<v>/bin)."""
    found = sorted(glob("/usr/lib/postgresql/*/bin/initdb"), key=lambda p: int(Path(p).parent.parent.name))
    if found:
        return Path(found[-1]).parent
    initdb = shutil.which("initdb")
    if initdb:
        return Path(initdb).resolve().parent
    raise RuntimeError("no PostgreSQL server installed (initdb not found). Fix: ./setup (apt-get install postgresql)")


def _free_port() -> int:
    for port in PORTS:
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        return port
    raise RuntimeError("no free port in 18480-18499")


def _as_user() -> tuple[list[str], str]:
    """argv prefix that runs a command as the cluster's owner, and that owner's name."""
    if os.geteuid() != 0:
        return [], pwd.getpwuid(os.geteuid()).pw_name
    return ["runuser", "-u", "postgres", "--"], "postgres"


class Cluster:
    """initdb, start, create a database, stop; `url()` is the SQLAlchemy-free libpq URL."""

    def __init__(self, root: Path) -> None:
        self.root, self.bin = root, pg_bin()
        self.data, self.sockets, self.log = root / "data", root / "sockets", root / "postgres.log"
        self.prefix, self.user = _as_user()
        self.port = 0

    def _run(self, *argv: str, timeout: float = 120) -> None:
        done = subprocess.run([*self.prefix, *argv], capture_output=True, text=True, timeout=timeout, cwd=self.root)
        if done.returncode != 0:
            raise RuntimeError(f"{' '.join(argv)}: exit {done.returncode}: {done.stderr.strip() or done.stdout.strip()}"
                               + (f"\n{self.log.read_text()[-2000:]}" if self.log.exists() else ""))

    def start(self) -> None:
        self.sockets.mkdir(parents=True)
        if self.prefix:
            shutil.chown(self.root, user="postgres")
            shutil.chown(self.sockets, user="postgres")
        self._run(str(self.bin / "initdb"), "-D", str(self.data), "-U", self.user, "--auth=trust", "-E", "UTF8",
                  "--no-sync", "--no-instructions")
        self.port = _free_port()
        opts = (f"-c listen_addresses=127.0.0.1 -p {self.port} -c unix_socket_directories={self.sockets} "
                "-c fsync=off -c max_connections=200")
        self._run(str(self.bin / "pg_ctl"), "-D", str(self.data), "-l", str(self.log), "-o", opts, "-w", "-t", "120",
                  "start")

    def create_database(self, name: str) -> str:
        self._run(str(self.bin / "createdb"), "-h", "127.0.0.1", "-p", str(self.port), "-U", self.user, name)
        return self.url(name)

    def url(self, database: str = "postgres") -> str:
        return f"postgresql://{self.user}@127.0.0.1:{self.port}/{database}"

    def stop(self) -> None:
        if (self.data / "postmaster.pid").exists():
            self._run(str(self.bin / "pg_ctl"), "-D", str(self.data), "-m", "fast", "-w", "stop")


@pytest.fixture(scope="session")
def postgres() -> Iterator[Cluster]:
    """One PostgreSQL cluster for the session; each user creates its own database in it."""
    root = Path(tempfile.mkdtemp(prefix="lanebench-pg-"))
    os.chmod(root, 0o755)
    cluster = Cluster(root)
    try:
        cluster.start()
        yield cluster
    finally:
        cluster.stop()
        shutil.rmtree(root, ignore_errors=True)
