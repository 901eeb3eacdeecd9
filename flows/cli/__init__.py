"""The `lanebench` command.

Exit codes: 0 every lane that ran passed (skipped lanes named); 1 a gate, a bar, an
expectation or a regression failed; 2 bad input (one line naming file, field and fix; nothing
is run); 3 nothing was measured (every lane skipped by a precondition); 130 interrupted
(Ctrl-C or SIGTERM). The last line printed names the run folder.
"""

from __future__ import annotations

import argparse
import atexit
import logging
import os
import sys
from collections.abc import Callable
from importlib import import_module
from pathlib import Path
from typing import Any, NoReturn

from tasks.inventory.paths import REPO

DEFAULT_HOSTS = REPO / "hosts.yaml"
# Commands that bring their own subcommand: each module has register_cli(subparsers), which
# must stay cheap to import (no Prefect or GX at import time). The flows themselves
# (flows/nightly.py, kl.py, matrix.py, tools.py) are Prefect flows defined at module level,
# imported only once a command has checked its input and launched the API server.
_SUBCOMMANDS: list[str] = ["flows.cli.kl", "flows.cli.matrix", "flows.history", "flows.cli.tools", "flows.lab",
                           "flows.cli.launch",
                           "flows.plan"]


def _bad_input(message: str) -> int:
    print(f"lanebench: error: {message}", file=sys.stderr)
    return 2


def artifacts_arg(value: str, resolve: bool = False) -> tuple[str, Path]:
    """--artifacts as the flow's parameter and the local folder the run folder appears in: a store
    URL (tasks/record/store.py) is passed on as it is and written in the store's local mirror."""
    from tasks.record.store import Store, StoreError, is_url

    if is_url(value):
        try:
            return value, Store(value).local_root
        except StoreError as e:
            raise SystemExit(_bad_input(str(e))) from None
    path = Path(value).resolve() if resolve else Path(value)
    return str(path), path


def _quiet_prefect() -> None:
    """Telemetry off; Prefect's own logs at WARNING so the progress display stays readable.
    Prefect reads its settings once, at its first import: called before anything imports it."""
    os.environ.setdefault("DO_NOT_TRACK", "1")
    os.environ.setdefault("PREFECT_LOGGING_LEVEL", "WARNING")
    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
    # The API server takes 15-25 s on 2 idle cores; its default 20 s limit fails on a busy box.
    os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "120")
    logging.getLogger("great_expectations").setLevel(logging.WARNING)


def run_flow(flow: str, build: Callable[[], Any], artifacts: Path, launched: tuple[Any, str] | None = None,
             **params: Any) -> tuple[Any, Path | None]:
    """Call a flow the way every flow command does; returns its final state and its run folder.

    Prefect's API server runs in a session of its own (flows/api_server.py), so a terminal's
    Ctrl-C spares it and the run can record its own end; it is launched before `build` imports
    the flow modules, so it boots meanwhile (or earlier: `launched`, from `api_server.launch()`,
    when the command launched it before checking its input). Ctrl-C and SIGTERM then stop the run: the flow
    tears its lane down, marks its run folder interrupted and ends in a state named Interrupted
    (exit 130, `tasks/record/verdict.py`). Nothing secret reaches Prefect
    (`tasks/record/prefect_redaction.py`).
    """
    _quiet_prefect()
    from flows.api_server import api_server, launch

    launched = launched or launch()  # None again when PREFECT_API_URL names a server
    from tasks.record.interrupted import install_stop_handlers
    from tasks.record.prefect_redaction import install
    from tasks.record.progress import run_folder_of

    install_stop_handlers()
    install()  # before the flow run exists: its creation and first states are scrubbed too
    call = build()
    import prefect.flow_engine  # (Prefect imports its engines at the first flow call:
    import prefect.task_engine  # noqa: F401 - imported here, they load while the API server boots)
    with api_server(launched):
        state = call(**params, return_state=True)
    return state, run_folder_of(state, artifacts, flow)


def interrupted_exit(state: Any, folder: Path | None, flow: str) -> int | None:
    """130 with the closing line when the run was stopped by a signal, else None (the command
    closes with its own verdict)."""
    from tasks.record.progress import closing_verdict
    from tasks.record.verdict import EXIT_CODES, exit_code_of

    if exit_code_of(state) != EXIT_CODES["interrupted"]:
        return None
    return closing_verdict(state, folder, flow)


def cmd_nightly(args: argparse.Namespace) -> int:
    # Prefect's API server first (flows/api_server.py): it boots (~6 s on 2 cores) while the
    # inventory is checked and the flow modules import, instead of after them. Bad input stops it.
    from flows.api_server import launch, stop

    launched = launch()
    try:
        refused = _refused_nightly(args)
    except BaseException:
        stop(launched)
        raise
    if refused is not None:
        stop(launched)
        return refused

    def build() -> Any:
        import flows.lane  # noqa: F401  (imported by the first lane otherwise: after the API server is up)
        from flows.nightly import nightly, warm

        warm()  # GX and matplotlib load now, while the API server boots
        return nightly

    hosts = Path(args.hosts)
    root, artifacts = artifacts_arg(args.artifacts)
    state, folder = run_flow("nightly", build, artifacts, launched=launched, hosts=str(hosts.resolve()),
                             lanes=args.lane, artifacts_root=root)
    from tasks.record.progress import closing_verdict

    return closing_verdict(state, folder, "nightly")


def _refused_nightly(args: argparse.Namespace) -> int | None:
    """Exit 2 with one line for an inventory the nightly cannot run; None when it can."""
    from tasks.inventory.models import ConfigError
    from tasks.inventory.load import load_inventory
    from tasks.stages.input_files import check_prompt_files

    hosts = Path(args.hosts)
    try:
        inventory = load_inventory(hosts)
    except ConfigError as e:
        return _bad_input(str(e))
    unknown = [name for name in args.lane or [] if name not in inventory.lanes]
    if unknown:
        return _bad_input(f"--lane {unknown[0]}: no such lane in {hosts}. Fix: use one of: {', '.join(inventory.lanes)}")
    if (capped := _capped_by_config(inventory, args.lane or list(inventory.lanes))) is not None:
        return _bad_input(f"{hosts}: {capped}")
    try:
        check_prompt_files(inventory, hosts)
    except ConfigError as e:
        return _bad_input(str(e))
    return None


def _capped_by_config(inventory, names: list[str]) -> str | None:
    """A lane whose own config caps running requests below its bench (and gates on capacity) fails
    for sure: said before anything is pulled or booted (`lanebench plan` shows the computation)."""
    from tasks.engines import engine_for, planned

    for name in names:
        lane = inventory.lanes[name]
        if (reason := planned.check(lane, engine_for(lane.engine).planned_cap(lane))) is not None:
            return f"lanes.{name}.flags: {reason}"
    return None


def cmd_verify(args: argparse.Namespace) -> int:
    from tasks.record.audit import audit
    from tasks.record.store import is_url

    if is_url(args.run):
        return _verify_in_store(args.run)
    run = Path(args.run)
    if not (run / "manifest.json").is_file():
        return _bad_input(f"{run}: no manifest.json there. Fix: pass a run folder, e.g. artifacts/<time>_nightly_<id>")
    result = audit(run)
    for kind in ("missing", "changed", "extra"):
        for rel in getattr(result, kind):
            print(f"{kind}: {rel}")
    for line in result.problems:
        print(f"problem: {line}")
    print(f"{'ok' if result.ok else 'FAILED'}: {result.checked} files listed in the manifest, "
          f"{len(result.missing)} missing, {len(result.changed)} changed, {len(result.extra)} extra"
          + (f", {len(result.problems)} problems" if result.problems else ""))
    if result.ledger:  # after the verdict line, which a good folder's output starts with
        print(f"ledger: {result.ledger}")
    return 0 if result.ok else 1


def _verify_in_store(address: str) -> int:
    """`verify sftp://host/root/RUN`: the run folder as the store holds it, downloaded as it is
    (no check on the way) and audited against its manifest like a local one."""
    import tempfile

    from tasks.record.audit import audit
    from tasks.record.store import Store, StoreError

    root, _, name = address.rstrip("/").rpartition("/")
    try:
        store = Store(root)
        if name not in store.published():
            return _bad_input(f"{address}: no such run folder in the store. Fix: lanebench history --artifacts {root}")
        with tempfile.TemporaryDirectory(prefix="lanebench-verify-") as tmp:
            result = audit(store.download(name, Path(tmp)))
    except StoreError as e:
        return _bad_input(str(e))
    for kind in ("missing", "changed", "extra"):
        for rel in getattr(result, kind):
            print(f"{kind}: {rel}")
    print(f"{'ok' if result.ok else 'FAILED'}: {result.checked} files listed in the manifest, "
          f"{len(result.missing)} missing, {len(result.changed)} changed, {len(result.extra)} extra ({address})")
    return 0 if result.ok else 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="lanebench", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("nightly", help="run every lane (or the named ones) through the lane flow")
    p.add_argument("--hosts", default=str(DEFAULT_HOSTS), help="inventory file (default: the shipped hosts.yaml)")
    p.add_argument("--lane", action="append", help="run only this lane (repeatable)")
    p.add_argument("--artifacts", default=str(REPO / "artifacts"),
                   help="folder that receives the run folder, or a store URL (sftp://host/path) it is published to")
    p.set_defaults(func=cmd_nightly)
    p = sub.add_parser("verify", help="check every file of a run folder against the sha256 in its manifest")
    p.add_argument("run", help="the run folder (a path, or its address in a store: sftp://host/root/RUN)")
    p.set_defaults(func=cmd_verify)
    for module in _SUBCOMMANDS:
        import_module(module).register_cli(sub)
    args = parser.parse_args(argv)
    # Prefect reads its settings once, at its first import: quiet them before any command's
    # checks import a module that imports Prefect.
    _quiet_prefect()
    try:
        return args.func(args)
    except KeyboardInterrupt:
        print("lanebench: interrupted; what was measured so far is in the run folder", file=sys.stderr)
        return 130


def run() -> NoReturn:
    """The `lanebench` script: `main`, then exit without the interpreter's teardown.

    After a flow the process holds Prefect's, pandas' and GX's objects, and freeing them module
    by module took 1.5 s after the last line was printed (measured on the 2-core rehearsal box,
    docs/benchmarks.md). By then the run folder is complete and its servers are stopped; the
    atexit handlers and the log handlers still run here, only the teardown is skipped.
    """
    code = main()
    atexit._run_exitfuncs()  # what a normal exit runs first (logging.shutdown among them)
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except OSError:  # a reader that went away (`lanebench history runs | head`)
            pass
    os._exit(code)
