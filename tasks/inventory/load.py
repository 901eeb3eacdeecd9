"""The inventory, read through the one YAML-to-model loader (tasks/inventory/config_file.py):
every mistake in it is one line naming file, field and fix."""

from __future__ import annotations

from pathlib import Path

from tasks.inventory import secrets
from tasks.inventory.config_file import load_model
from tasks.inventory.flag_conflicts import EngineFor
from tasks.inventory.models import Inventory
from tasks.inventory.paths import REPO


def load_inventory(path: str | Path, engine_for: EngineFor) -> Inventory:
    """Read and validate an inventory file; any problem is one ConfigError. `engine_for`
    (tasks.engines.engine_for) reads each lane's draft plan as its engine will."""
    inventory = load_model(path, Inventory, keys="'hosts' and 'lanes'", example="the shipped hosts.yaml",
                           missing_fix="pass an existing file with --hosts, or run without --hosts for the rehearsal lane",
                           context={"engine_for": engine_for})
    secrets.remember(inventory)  # scrubbed from whatever this process says about any lane from now on
    return inventory


DEFAULT_INVENTORY = REPO / "hosts.yaml"


def shipped_or_local(base: Path, rel: str) -> Path:
    """A file the inventory names, relative to its folder, else in the checkout (the shipped tool suites,
    protocol and chat templates work from an inventory kept anywhere)."""
    p = Path(rel).expanduser()
    if p.is_absolute():
        return p
    local = (base / p).resolve()
    if not local.exists() and (REPO / p).exists():
        return (REPO / p).resolve()
    return local
