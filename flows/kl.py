"""The KL gate: is a quantized (or otherwise changed) checkpoint close enough to its reference?

    quantize (where asked) -> reference: preflight, boot, tokenizer probe, greedy continuations,
    teacher-forced scoring twice (exactness) -> each candidate in turn: preflight, boot,
    tokenizer probe, teacher-forced scoring of the same token ids -> tables (GX), histogram,
    report.md, Prefect artifacts                                   (teardown on every path)

The seeds' "Which NVFP4? Measured, not vibes", made rerunnable for every new checkpoint. The
gate refuses to judge when the instrument is not exact (the reference's two scorings of its
own text differ) and refuses a candidate whose tokenizer differs; a candidate that dies
mid-scoring keeps its partial results, marked, and fails. Every lane, local, SSH, container
or across hosts, is served through the same lifecycle as the nightly's (tasks/stages/serve.py)
under its host lock.

Run it with `lanebench kl FILE` (flows/cli/kl.py checks the file first) or as the `kl`
deployment of prefect.yaml.
"""

from __future__ import annotations

from pathlib import Path

from prefect import flow
from prefect.runtime import flow_run
from prefect.states import Completed, Failed, State

from tasks.client.prompts import load_prompts
from tasks.kl.config import load_kl_file, resolve, resolve_lanes
from tasks.kl.gate import Gate
from tasks.record.interrupted import interrupts, raise_if_stopped, record_stop
from tasks.record.run_folder import RunFolder


@flow(name="kl", flow_run_name="kl-{kl_file}")
def kl_gate(kl_file: str, artifacts_root: str = "artifacts", prompt_count: int | None = None) -> State:
    """One KL run of `kl_file` into a new run folder under `artifacts_root`; `prompt_count`
    scores only the first N prompts (a quick check, said in the report's title). A store URL as
    `artifacts_root` gets the run folder published (tasks/record/store.py)."""
    from tasks.record.store import in_store

    return in_store(artifacts_root, "kl", str(flow_run.get_id()),
                    lambda root: _kl_gate(kl_file, root, prompt_count))


def _kl_gate(kl_file: str, artifacts_root: str, prompt_count: int | None) -> State:
    path = Path(kl_file).resolve()
    spec = load_kl_file(path)
    lanes = resolve_lanes(spec, path)
    prompts = load_prompts(resolve(path.parent, spec.prompts), prompt_count or spec.prompt_count)
    run = RunFolder(Path(artifacts_root), "kl", str(flow_run.get_id()), path)
    title = path.name + (f" (first {len(prompts)} prompts only)" if prompt_count else "")
    gate = Gate(run, spec, lanes, prompts, title)
    try:
        gate.prepare_models()
        raise_if_stopped()
        if gate.reference():
            for name in spec.candidates:
                raise_if_stopped()
                gate.candidate(name)
        raise_if_stopped()
    except interrupts() as e:  # no verdict from a gate cut short: the scores so far are kept
        stopped = record_stop(run, "kl", e, [spec.reference, *spec.candidates])
        run.finish()
        return Failed(name="Interrupted", message=stopped)
    except BaseException:
        gate.finish()
        raise
    passed, reasons = gate.finish()
    return Completed(message=str(run.path)) if passed else Failed(message="; ".join(reasons))
