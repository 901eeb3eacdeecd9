"""Engine differences asked of the `Engine`, through the code that asks them: the config checks,
the KL file, a lane across hosts, a matrix arm's slots and the pinned-build comparison decide per
engine as they did when each one branched on the engine's name (tests/test_layout.py keeps the
branches out)."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import yaml

from tasks.inventory.base import ConfigError
from tasks.inventory.load import load_inventory
from tasks.engines import engine_for
from tasks.inventory.models import FileRef, Lane
from tasks.kl.config import load_kl_file, resolve_lanes
from tasks.matrix.config import arm_lane, load_matrix
from tasks.stages.input_files import check_model_files
from tasks.stages.safety import pinned_identity
from tasks.stages.topology import spans_nodes

REPO = Path(__file__).resolve().parent.parent
GGUF = REPO / "testbed" / "models" / "target-f16.gguf"


def _rehearsal() -> tuple[Lane, object]:
    inventory = load_inventory(REPO / "hosts.yaml", engine_for)
    return inventory.lanes["rehearsal"], inventory


def _as(lane: Lane, engine: str, model: Path, **update: object) -> Lane:
    return lane.model_copy(update={"engine": engine, "model": FileRef(path=str(model)), "drafter": None, **update})


@pytest.mark.parametrize("engine, made, problem", [
    ("vllm", "folder", "folder without config.json"),
    ("sglang", "folder", "folder without config.json"),
    ("vllm", "hf-folder", None),
    ("vllm", "text", None),  # vLLM and SGLang name no magic bytes: a single file is theirs to judge
    ("llamacpp", "hf-folder", "not a regular file"),
    ("llamacpp", "text", "not a GGUF file"),
    ("llamacpp", "gguf", None),
])
def test_model_files_are_judged_by_the_engine_that_loads_them(tmp_path, engine, made, problem):
    lane, inventory = _rehearsal()
    target = tmp_path / "model"
    if made == "folder":
        target.mkdir()
    elif made == "hf-folder":
        target.mkdir()
        (target / "config.json").write_text("{}")
    elif made == "text":
        target.write_text("not a model")
    else:
        shutil.copyfile(GGUF, target)
    served = _as(lane, engine, target)
    if problem is None:
        check_model_files("x", served, inventory, tmp_path, tmp_path / "hosts.yaml")  # type: ignore[arg-type]
        return
    with pytest.raises(ConfigError) as e:
        check_model_files("x", served, inventory, tmp_path, tmp_path / "hosts.yaml")  # type: ignore[arg-type]
    assert problem in str(e.value) and "lanes.x.model.path" in str(e.value)
    if made == "hf-folder":  # llama.cpp loads one file: the fix does not offer a folder
        assert "the model file itself" in str(e.value)


def _kl_file(tmp_path: Path, engine: str) -> Path:
    lane = {"engine": engine, "model": {"path": str(GGUF)}, "port": 18411, "context": 512}
    spec = {"inventory": str(REPO / "hosts.yaml"), "prompts": str(REPO / "kl" / "prompts.jsonl"), "prompt_count": 2,
            "tokens_per_prompt": 8, "reference": "ref", "candidates": ["cand"],
            "lanes": {"ref": {**lane, "engine": "llamacpp"}, "cand": {**lane, "port": 18412, "quantize": {"type": "Q8_0"}}},
            "bars": {"max_mean_abs_dlogprob": 0.02}}
    path = tmp_path / "kl.yaml"
    path.write_text(yaml.safe_dump(spec))
    return path


def test_only_an_engine_that_serves_llama_quantize_output_takes_quantize(tmp_path):
    path = _kl_file(tmp_path, "llamacpp")
    assert resolve_lanes(load_kl_file(path), path)["cand"].quantize_source == GGUF
    path = _kl_file(tmp_path, "vllm")
    with pytest.raises(ConfigError) as e:
        resolve_lanes(load_kl_file(path), path)
    assert "quantize needs a llamacpp lane, this one is vllm" in str(e.value)


@pytest.mark.parametrize("engine, spans", [("llamacpp", False), ("vllm", True), ("sglang", True)])
def test_a_lane_across_hosts_takes_node_flags_unless_its_engine_spans_by_rpc(engine, spans):
    lane, _ = _rehearsal()
    data = lane.model_dump(exclude={"drafter", "speculative", "gates", "waivers"})
    data.update(engine=engine, nodes={"hosts": [lane.host, "worker"], "link": "l"}, bench={**data["bench"], "acceptance": None},
                flags=[])
    across = Lane.model_validate(data)
    assert spans_nodes(across) is spans
    assert (across.rpc is not None) is (not spans)  # llama.cpp's nodes are its rpc plan's workers


def test_a_matrix_arms_slot_flag_is_its_slots_on_an_engine_that_has_one():
    m = load_matrix(REPO / "matrix" / "rehearsal.yaml")
    arm = m.arms[0].model_copy(update={"flags": ("--parallel", "1")})
    assert m.target.engine == "llamacpp" and m.target.slots != 1
    assert arm_lane(m, arm).slots == 1
    as_vllm = m.model_copy(update={"target": m.target.model_copy(update={"engine": "vllm"})})
    assert arm_lane(as_vllm, arm.model_copy(update={"flags": ("--max-num-seqs", "1")})).slots == m.target.slots


def test_only_a_pinned_engines_own_binary_is_compared_with_the_pin():
    lane, _ = _rehearsal()
    assert lane.binary is None and pinned_identity(lane) is None  # the lane runs the pin itself
    assert pinned_identity(lane.model_copy(update={"engine": "vllm", "binary": "/usr/bin/true"})) is None
