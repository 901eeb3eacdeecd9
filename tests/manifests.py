"""Manifests as RunFolder writes them, for tests that need an earlier run folder without running one."""

from __future__ import annotations

from pathlib import Path

from tasks.record.manifest import ArtifactEntry, FileRef, FlowRecord, Manifest, MatrixSection

ZERO = "0" * 64


def write_manifest(folder: Path, flow: str = "nightly", started: str = "2026-12-01T00:00:00+00:00",
                   artifacts: list[ArtifactEntry] | None = None, matrix: MatrixSection | None = None) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    m = Manifest(flow=FlowRecord(name=flow, flow_run_id=f"{folder.name}-id", started_at=started, matrix=matrix),
                 artifacts=artifacts or [])
    (folder / "manifest.json").write_text(m.model_dump_json(indent=2))
    return folder


def matrix_section(registration: dict, subject: str = "") -> MatrixSection:
    """A matrix run's section with only its registration and subject meaning anything."""
    return MatrixSection(subject=subject, name=str(registration.get("matrix")), file="m.yaml", file_sha256=ZERO,
                         inventory=FileRef(path="hosts.yaml", sha256=ZERO), target="target", registration_sha256=ZERO,
                         registration_file_sha256=ZERO, registration=registration)
