"""The KL gate: is a quantized (or otherwise changed) checkpoint close enough to its reference?

    quantize (where asked) -> reference: preflight, boot, tokenizer probe, greedy continuations,
    teacher-forced scoring twice (exactness) -> each candidate in turn: preflight, boot,
    tokenizer probe, teacher-forced scoring of the same token ids -> tables (GX), histogram,
    report.md, Prefect artifacts                                   (teardown on every path)

The gate refuses to judge when the instrument is not exact (the reference's two scorings of its
own text differ) and refuses a candidate whose tokenizer differs; a candidate that dies
mid-scoring keeps its partial results, marked, and fails.
"""

from __future__ import annotations

from pathlib import Path

from prefect import flow
from prefect.states import Completed, Failed, State

from flows.lifecycle import NOTIFY, Closing, in_artifacts, open_run, run_lifecycle
from tasks.client.prompts import load_prompts
from tasks.kl.config import load_kl_file, resolve, resolve_lanes
from tasks.kl.gate import Gate
from tasks.record.interrupted import raise_if_stopped


@flow(name="kl", flow_run_name="kl-{kl_file}", **NOTIFY)
def kl_gate(kl_file: str, artifacts_root: str = "artifacts", prompt_count: int | None = None) -> State:
    """One KL run of `kl_file` into a new run folder under `artifacts_root` (or a store URL);
    `prompt_count` scores only the first N prompts (said in the report's title)."""
    return in_artifacts("kl", artifacts_root, lambda root: _kl_gate(kl_file, root, prompt_count))


def _kl_gate(kl_file: str, artifacts_root: str, prompt_count: int | None) -> State:
    path = Path(kl_file).resolve()
    spec = load_kl_file(path)
    lanes = resolve_lanes(spec, path)
    prompts = load_prompts(resolve(path.parent, spec.prompts), prompt_count or spec.prompt_count)
    title = path.name + (f" (first {len(prompts)} prompts only)" if prompt_count else "")
    run = open_run("kl", artifacts_root, path)
    gate = Gate(run, spec, lanes, prompts, title)
    closing = Closing(report=lambda _: gate.finish(), finish_after_report=True,
                      verdict=lambda run, judged: Completed(message=str(run.path)) if judged[0]
                      else Failed(message="; ".join(judged[1])))
    with run_lifecycle(run, "kl", [spec.reference, *spec.candidates], closing) as life:
        gate.prepare_models()
        raise_if_stopped()
        if gate.reference():
            for name in spec.candidates:
                raise_if_stopped()
                gate.candidate(name)
    return life.state
