"""The artifacts root as a URL: one run history for every worker of a team.

A worker writes its run folder locally, then publishes it: copied under `<root>/.incoming/`, every
file checked against the manifest's sha256 there, then renamed into place (a reader sees all of it
or none). Readers (`history`, `verify`, regression baselines) work on a local mirror of the
published folders, each file checked as it arrives: the folders stay the truth, the mirror a cache.

Roots: a local path (or `file://`), nothing copied; `sftp://[user@]host[:port]/abs/path` over
paramiko with the lanes' host-key policy (tasks/hosts/ssh.py: an unknown or changed key refused),
key and known_hosts from LANEBENCH_STORE_IDENTITY / LANEBENCH_STORE_KNOWN_HOSTS; mirrors under
LANEBENCH_STORE_MIRRORS (default ~/.cache/lanebench/stores/<hash of the URL>).
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import os
import shutil
import uuid
from collections.abc import Callable
from pathlib import Path
from urllib.parse import urlsplit

from fsspec import AbstractFileSystem
from fsspec.implementations.sftp import SFTPFileSystem

from tasks.hosts.files import file_sha256
from tasks.record.manifest import ManifestError, read_manifest

INCOMING = ".incoming"
MIRRORS_ENV = "LANEBENCH_STORE_MIRRORS"  # where this machine keeps its mirrors of stores


class StoreError(RuntimeError):
    """The store refused a publish or a read (the message names the file and why)."""


def is_url(root: str | os.PathLike) -> bool:
    return "://" in str(root) and not str(root).startswith("file://")


class _VerifiedSFTP(SFTPFileSystem):
    """fsspec's SFTP filesystem on a lanebench SSH connection: the host key is checked against
    known_hosts exactly as for a lane's host (fsspec's own default trusts any key)."""

    protocol = ("sftp",)

    def __init__(self, host: str, port: int = 22, user: str | None = None) -> None:
        self._where = (host, port, user)
        super().__init__(host, port=port, username=user, host_key_policy="reject")

    def _connect(self) -> None:
        import paramiko

        from tasks.hosts.ssh import SSHTransport

        host, port, user = self._where
        self._transport = SSHTransport(f"store {host}", host, port=port, user=user,
                                       identity_file=os.environ.get("LANEBENCH_STORE_IDENTITY", "~/.ssh/id_ed25519"),
                                       known_hosts=os.environ.get("LANEBENCH_STORE_KNOWN_HOSTS", "~/.ssh/known_hosts"))
        from tasks.hosts.transport import TransportError

        self.client = None
        try:
            self.ftp = paramiko.SFTPClient.from_transport(self._transport._connection())
        except TransportError as e:  # HostKeyError among them: the message names the fix
            raise StoreError(f"sftp://{host}:{port}: {e}") from None


def _sha256(fs: AbstractFileSystem, path: str) -> str:
    with fs.open(path, "rb") as f:
        return file_sha256(f)


class Store:
    """One artifacts root: `local_root` is where run folders are written and read on this machine."""

    def __init__(self, root: str | os.PathLike) -> None:
        self.url = str(root)
        self.remote = is_url(root)
        if not self.remote:
            self.path = str(Path(str(root).removeprefix("file://")).expanduser())
            return
        parts = urlsplit(self.url)
        if parts.scheme != "sftp" or not parts.hostname or not parts.path.startswith("/"):
            raise StoreError(f"artifacts root {self.url}: only a local path or sftp://[user@]host[:port]/abs/path "
                             "is supported. Fix: give one of those")
        self._where = (parts.hostname, parts.port or 22, parts.username)
        self.path = parts.path.rstrip("/")

    @functools.cached_property
    def fs(self) -> AbstractFileSystem:
        """A remote store's filesystem, connected at first use (a local root uses plain paths)."""
        assert self.remote, f"{self.url} is a local root: no filesystem to ask"
        return _VerifiedSFTP(*self._where)

    @property
    def local_root(self) -> Path:
        """The folder this machine writes run folders into and reads history from."""
        if not self.remote:
            return Path(self.path)
        key = hashlib.sha256(self.url.encode()).hexdigest()[:16]
        return Path(os.path.expanduser(os.environ.get(MIRRORS_ENV, "~/.cache/lanebench/stores"))) / key

    def publish(self, folder: Path) -> str:
        """Copy `folder` into the store, check every listed file's sha256 there, rename it into place;
        returns its address (a local root: the folder, already there)."""
        folder = Path(folder)
        if not self.remote:
            return str(folder)
        listed = {a.path: a.sha256 for a in read_manifest(folder).artifacts}
        final = f"{self.path}/{folder.name}"
        if self.fs.exists(final):
            raise StoreError(f"{self.url}: {folder.name} is already published; a run folder is written once")
        staging = f"{self.path}/{INCOMING}/{folder.name}.{uuid.uuid4().hex[:8]}"
        try:
            for path in sorted(p for p in folder.rglob("*") if p.is_file()):
                rel = path.relative_to(folder).as_posix()
                self.fs.put_file(str(path), f"{staging}/{rel}")
            for rel, digest in listed.items():
                if not self.fs.exists(f"{staging}/{rel}"):
                    raise StoreError(f"{self.url}/{INCOMING}: {folder.name}/{rel} missing after the copy")
                if (got := _sha256(self.fs, f"{staging}/{rel}")) != digest:
                    raise StoreError(f"{self.url}/{INCOMING}: {folder.name}/{rel} sha256 {got[:12]} after the copy, "
                                     f"manifest says {digest[:12]}")
            if _sha256(self.fs, f"{staging}/manifest.json") != file_sha256(folder / "manifest.json"):
                raise StoreError(f"{self.url}/{INCOMING}: {folder.name}/manifest.json changed in the copy")
            self.fs.mv(staging, final)  # one rename: the folder appears whole
        except BaseException:
            with contextlib.suppress(Exception):
                self.fs.rm(staging, recursive=True)
            raise
        return f"{self.url.rstrip('/')}/{folder.name}"

    def published(self) -> list[str]:
        """Names of the run folders in the store (those with a manifest), oldest first."""
        if not self.remote:
            return sorted(p.parent.name for p in Path(self.path).glob("*/manifest.json"))
        if not self.fs.exists(self.path):
            return []
        names = [Path(p).name for p in self.fs.ls(self.path, detail=False)]
        return sorted(n for n in names if not n.startswith(".") and self.fs.exists(f"{self.path}/{n}/manifest.json"))

    def download(self, name: str, into: Path) -> Path:
        """One run folder as the store holds it, into `into/<name>`, unchecked (for `verify`)."""
        target = Path(into) / name
        if self.remote:
            self.fs.get(f"{self.path}/{name}/", str(target), recursive=True)
        else:
            shutil.copytree(Path(self.path) / name, target)
        return target

    def fetch(self, name: str, into: Path) -> Path:
        """One run folder into `into/<name>`, every listed file's sha256 checked; renamed in once complete."""
        if not self.remote:
            return Path(self.path) / name
        target = Path(into) / name
        if (target / "manifest.json").is_file():
            return target
        tmp = Path(into) / f".{name}.{uuid.uuid4().hex[:8]}.partial"
        try:
            self.fs.get(f"{self.path}/{name}/", str(tmp), recursive=True)
            try:
                manifest = read_manifest(tmp)
            except ManifestError as e:
                raise StoreError(f"{self.url}/{name}/manifest.json: {e.why}. Fix: lanebench verify {self.url}/{name}") from None
            for a in manifest.artifacts:
                path = tmp / a.path
                if not path.is_file() or file_sha256(path) != a.sha256:
                    raise StoreError(f"{self.url}/{name}/{a.path}: missing or not the sha256 its manifest lists. "
                                     f"Fix: lanebench verify {self.url}/{name}")
            tmp.rename(target)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
        return target

    def sync(self, on_refused: Callable[[str], object]) -> Path:
        """Every published run folder into the local mirror (returned); one whose files do not match
        its manifest stays out, and `on_refused` gets the line."""
        root = self.local_root
        root.mkdir(parents=True, exist_ok=True)
        if self.remote:
            for name in self.published():
                try:
                    self.fetch(name, root)
                except StoreError as e:
                    on_refused(f"store: refused {e}")
        return root


def in_store(artifacts_root: str, flow: str, flow_run_id: str, body):
    """Run a flow's body on a local root (a store's mirror, earlier runs there for baselines), then
    publish its run folder whatever the outcome (a failed night is a record too); a failed publish
    fails the flow run."""
    store = Store(artifacts_root)
    if not store.remote:
        return body(artifacts_root)
    from tasks.record.progress import progress, written_by

    root = store.sync(on_refused=lambda line: progress(flow, line))
    try:
        return body(str(root))
    finally:
        if (folder := written_by(root, flow, flow_run_id)) is not None:
            address = store.publish(folder)
            progress(flow, f"published {address} (every file's sha256 checked in the store)")
