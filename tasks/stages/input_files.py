"""The files a lane names exist and parse before anything runs: prompt sets, correctness inputs and
model files (here, above the parsers, so the inventory loader stays a loader of `hosts.yaml` alone).
"""

from __future__ import annotations

import os
from pathlib import Path

from tasks.client.prompts import load_prompts
from tasks.correctness.accuracy import load_mcq
from tasks.correctness.tool_grader import load_suite
from tasks.engines import engine_for
from tasks.inventory.base import ConfigError
from tasks.inventory.load import shipped_or_local
from tasks.inventory.paths import resolve
from tasks.inventory.models import Inventory, Lane, load_protocol


def check_prompt_files(inventory: Inventory, path: str | Path) -> None:
    """Prompt sets and correctness inputs are input, not preconditions: a missing or bad one is a ConfigError."""
    base = Path(path).resolve().parent
    for name, lane in inventory.lanes.items():
        files = {f"lanes.{name}.bench.decode.prompts": lane.bench.decode.prompts}
        if lane.bench.acceptance is not None:
            files |= {f"lanes.{name}.bench.acceptance.classes.{c}": p for c, p in lane.bench.acceptance.classes.items()}
        if lane.bench.prefill is not None and lane.bench.prefill.prompts is not None:
            files |= {f"lanes.{name}.bench.prefill.prompts": lane.bench.prefill.prompts}
        for field, rel in files.items():
            target = resolve(base, rel)
            fix = "point it at a JSONL file of {id, class, prompt} lines (paths are relative to this file)"
            if not target.is_file():
                raise ConfigError(path, field, f"prompt file {target} does not exist" if not target.exists() else
                                  f"prompt file {target} is not a regular file", fix)
            try:
                prompts = load_prompts(target)
            except (ValueError, KeyError, TypeError) as e:
                raise ConfigError(path, field, f"prompt file {target} has a line that is not "
                                  f"{{id, class, prompt}} JSON ({type(e).__name__}: {e})", fix) from None
            if not prompts:
                raise ConfigError(path, field, f"prompt file {target} holds no prompt", fix)
    for name, lane in inventory.lanes.items():
        _check_correctness_files(name, lane, base, path)
        check_model_files(name, lane, inventory, base, path)


def _escapes(rel: str) -> bool:
    """A relative path whose `..` climbs above the folder it is relative to."""
    return not Path(rel).is_absolute() and os.path.normpath(rel).split(os.sep)[0] == ".."


def check_model_files(name: str, lane: Lane, inventory: Inventory, base: Path, path: str | Path) -> None:
    """Model and drafter paths: no relative path out of the inventory's folder; on this machine a file
    that exists must be regular and start with its engine's magic bytes (GGUF). A missing file stays
    a precondition (the lane is skipped)."""
    host = inventory.hosts[lane.host]
    for role, ref in (("model", lane.model), ("drafter", lane.drafter)):
        if ref is None:
            continue
        field = f"lanes.{name}.{role}.path"
        if _escapes(ref.path):
            raise ConfigError(path, field, f"{ref.path} climbs out of the inventory's folder",
                              "give the file's absolute path, or a path under the inventory's folder")
        if host.transport != "local" or lane.image is not None:
            continue  # on another host or inside a container: preflight checks it there
        target = resolve(base, ref.path)
        if not target.exists():
            continue
        engine = engine_for(lane.engine)
        if target.is_dir() and engine.loads_model_folder:
            if not (target / "config.json").is_file():
                raise ConfigError(path, field, f"{target} is a folder without config.json, not a Hugging Face model folder",
                                  "point it at the model's folder (config.json, weights, tokenizer)")
            continue
        if not target.is_file():
            raise ConfigError(path, field, f"{target} is not a regular file (a directory, FIFO or device)",
                              "point it at the model file itself" if not engine.loads_model_folder else
                              "point it at the model file or its Hugging Face folder")
        if engine.model_magic is not None:
            try:
                with target.open("rb") as f:
                    magic = f.read(len(engine.model_magic))
            except OSError as e:
                raise ConfigError(path, field, f"{target} cannot be read ({e.strerror})",
                                  "make the file readable") from None
            if magic != engine.model_magic:
                kind = engine.model_magic.decode()
                raise ConfigError(path, field, f"{target} is not a {kind} file (it starts with {magic!r}, not "
                                  f"{engine.model_magic!r})", f"point it at a .{kind.lower()} model file")


def _check_correctness_files(name: str, lane: Lane, base: Path, path: str | Path) -> None:
    checks: list[tuple[str, str, object, str]] = []
    if lane.bench.accuracy is not None:
        checks.append((f"lanes.{name}.bench.accuracy.file", lane.bench.accuracy.file, load_mcq,
                       "point it at a JSONL file of {question, choices, answer} lines (GPQA-Diamond's shape), "
                       "e.g. testbed/evals/mcq.jsonl"))
    if lane.agentic is not None and lane.agentic.chat_template is not None:
        checks.append((f"lanes.{name}.agentic.chat_template", lane.agentic.chat_template, None,
                       "point it at a Jinja chat template file (e.g. testbed/chat/testbed.jinja)"))
    plan = lane.correctness.tool_gate if lane.correctness else None
    if plan is not None:
        fix = "point it at a tool suite in the JSONL format of toolsuites/README.md"
        checks.append((f"lanes.{name}.correctness.tool_gate.dev", plan.dev, load_suite, fix))
        if plan.held_out is not None:
            checks.append((f"lanes.{name}.correctness.tool_gate.held_out", plan.held_out, load_suite, fix))
        checks.append((f"lanes.{name}.correctness.tool_gate.protocol", plan.protocol, load_protocol,
                       "point it at a protocol file like toolsuites/protocol.yaml"))
    for field, rel, loader, fix in checks:
        target = shipped_or_local(base, rel)
        if not target.is_file():
            raise ConfigError(path, field, f"file {target} does not exist", fix + " (paths are relative to this file)")
        if loader is not None:
            try:
                loader(target)  # type: ignore[operator]
            except ValueError as e:
                raise ConfigError(path, field, f"{target}: {e}", fix) from None
            except ConfigError as e:  # the protocol file's own field, under the lane's
                raise ConfigError(path, field, f"{e.file}: {e.field}: {e.problem}", e.fix) from None
