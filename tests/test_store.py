"""The artifacts store over a real OpenSSH server on loopback (lab/sshd.py): publish, read, refuse.

A run folder reaches the store whole or not at all (write under .incoming, check every sha256
there, one rename); `verify` and `history` read the store's copy; an unknown host key is refused
as for a lane's host.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import REPO
from lab.sshd import make_keypair, start_sshd
from manifests import write_manifest
from prefect_stack import free_port

from tasks.record.manifest import ArtifactEntry


def _run_folder(root: Path, name: str) -> Path:
    """A run folder as RunFolder writes one: files, and a manifest listing each with its sha256."""
    folder = root / name
    (folder / "lane").mkdir(parents=True)
    (folder / "report.md").write_text("# report\n")
    (folder / "lane" / "server.log").write_bytes(os.urandom(300_000))  # > one SFTP packet
    listed = [ArtifactEntry(path=str(p.relative_to(folder)), kind="raw", lane="lane",
                            sha256=hashlib.sha256(p.read_bytes()).hexdigest())
              for p in sorted(folder.rglob("*")) if p.is_file()]
    return write_manifest(folder, artifacts=listed)


@pytest.fixture(scope="module")
def sftp_store(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("store")
    make_keypair(tmp / "id_ed25519", comment="lanebench-store-test")
    (tmp / "authorized_keys").write_text((tmp / "id_ed25519.pub").read_text())
    sshd = start_sshd(tmp / "sshd", "127.0.0.1", free_port(), tmp / "authorized_keys")
    (tmp / "known_hosts").write_text(sshd.known_hosts_line() + "\n")
    saved = {k: os.environ.get(k) for k in ("LANEBENCH_STORE_IDENTITY", "LANEBENCH_STORE_KNOWN_HOSTS", "LANEBENCH_STORE_MIRRORS")}
    os.environ.update(LANEBENCH_STORE_IDENTITY=str(tmp / "id_ed25519"), LANEBENCH_STORE_KNOWN_HOSTS=str(tmp / "known_hosts"),
                      LANEBENCH_STORE_MIRRORS=str(tmp / "mirrors"))
    (tmp / "remote").mkdir()
    try:
        yield {"url": f"sftp://{os.environ.get('USER', 'root')}@127.0.0.1:{sshd.port}{tmp / 'remote'}",
               "remote": tmp / "remote", "tmp": tmp, "sshd": sshd}
    finally:
        sshd.stop()
        for k, v in saved.items():
            os.environ.pop(k, None) if v is None else os.environ.__setitem__(k, v)


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "flows.cli", *args], capture_output=True, text=True, cwd=REPO,
                          timeout=300, env=os.environ)


def test_a_published_run_folder_is_whole_and_verifies_in_the_store(sftp_store, tmp_path):
    from tasks.record.store import INCOMING, Store

    folder = _run_folder(tmp_path, "20261202T000000Z_nightly_aaaaaaaa")
    address = Store(sftp_store["url"]).publish(folder)
    assert address == f"{sftp_store['url']}/{folder.name}"
    remote = sftp_store["remote"] / folder.name
    assert (remote / "lane" / "server.log").read_bytes() == (folder / "lane" / "server.log").read_bytes()
    assert list((sftp_store["remote"] / INCOMING).iterdir()) == []  # nothing left half-way
    ok = _cli("verify", address)
    assert ok.returncode == 0 and ok.stdout.startswith("ok: 2 files"), ok.stdout + ok.stderr
    # A file changed in the store after publishing: verify reads the store's copy and says so.
    (remote / "report.md").write_text("# edited\n")
    bad = _cli("verify", address)
    assert bad.returncode == 1 and "changed: report.md" in bad.stdout, bad.stdout + bad.stderr
    with pytest.raises(Exception, match="already published"):
        Store(sftp_store["url"]).publish(folder)  # a run folder is written once


def test_a_folder_that_changed_after_its_manifest_is_never_published(sftp_store, tmp_path):
    from tasks.record.store import INCOMING, Store, StoreError

    folder = _run_folder(tmp_path, "20261202T000100Z_nightly_bbbbbbbb")
    (folder / "lane" / "server.log").write_bytes(b"written on after the manifest was saved")
    with pytest.raises(StoreError, match=r"server.log sha256 .* after the copy, manifest says"):
        Store(sftp_store["url"]).publish(folder)
    assert not (sftp_store["remote"] / folder.name).exists()
    assert list((sftp_store["remote"] / INCOMING).iterdir()) == []


def test_the_mirror_takes_only_whole_published_folders(sftp_store, tmp_path):
    from tasks.record.store import Store

    folder = _run_folder(tmp_path, "20261202T000200Z_nightly_cccccccc")
    Store(sftp_store["url"]).publish(folder)
    half = sftp_store["remote"] / ".incoming" / "20261202T000300Z_nightly_dddddddd.0000"
    half.mkdir(parents=True)  # another worker's publish in flight: not a run folder yet
    (half / "manifest.json").write_text("{}")
    try:
        refused: list[str] = []
        root = Store(sftp_store["url"]).sync(on_refused=refused.append)
        # the folder edited in the store by the first test stays out, named; the others come in
        assert [line for line in refused if "aaaaaaaa/report.md" in line], refused
        assert not (root / "20261202T000000Z_nightly_aaaaaaaa").exists()
        assert (root / folder.name / "lane" / "server.log").read_bytes() == (folder / "lane" / "server.log").read_bytes()
        assert not any("dddddddd" in p.name for p in root.iterdir())
    finally:
        (half / "manifest.json").unlink()
        half.rmdir()


def test_an_unknown_host_key_is_refused(sftp_store, tmp_path):
    empty = tmp_path / "known_hosts"
    empty.write_text("")
    env = dict(os.environ, LANEBENCH_STORE_KNOWN_HOSTS=str(empty))
    done = subprocess.run([sys.executable, "-m", "flows.cli", "history", "--artifacts", sftp_store["url"]],
                          capture_output=True, text=True, cwd=REPO, timeout=300, env=env)
    assert done.returncode != 0 and "unknown host key for 127.0.0.1" in done.stderr, done.stderr[-2000:]
    assert "Traceback" not in done.stderr


def test_a_store_url_of_another_scheme_is_bad_input():
    done = _cli("history", "--artifacts", "s3://bucket/runs")
    assert done.returncode == 2 and "only a local path or sftp://" in done.stderr and "Traceback" not in done.stderr
