"""`lanebench lab`: the users' topology (GB300, a Spark pair, a direct cable) on this machine.

    lanebench lab up             namespaces gb300/spark1/spark2 with sshd, gb300's dockerd, the
                                 registry, the image; writes hosts.lab.yaml (a leftover lab goes first)
    lanebench lab down           removes every namespace, veth, bridge, process, container and mount
    lanebench lab status         what is running; exit 1 when the lab is not (fully) up
    lanebench lab cut-link       take the spark1<->spark2 direct link down
    lanebench lab restore-link   bring it back

Needs root. One lab per machine: a command fails while a test session holds the lab.
Cheap to import: the lab modules load when a command runs.
"""

from __future__ import annotations

import argparse
import sys

ACTIONS = ("up", "down", "status", "cut-link", "restore-link")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="lanebench lab", description=__doc__.splitlines()[0])
    parser.add_argument("action", choices=ACTIONS)
    return _run(parser.parse_args(argv).action)


def _run(action: str) -> int:
    from lab.lab import Lab, LabError, lab_lock
    from lab.netns import NetnsError

    lab = Lab(say=lambda line: print(line, flush=True))
    try:
        if action == "status":
            ok, lines = lab.status()
            print("\n".join(lines))
            return 0 if ok else 1
        with lab_lock():
            return _locked(lab, action)
    except (LabError, NetnsError) as e:
        print(f"lanebench: error: {e}", file=sys.stderr)
        return 1


def _locked(lab, action: str) -> int:  # lab: lab.lab.Lab (imported lazily)
    if action == "up":
        lab.up()
        ok, lines = lab.status()
        print("\n".join(lines))
        return 0 if ok else 1
    if action == "down":
        lab.down()
        left = lab.leftovers()
        print("lab: down" if not left else f"lab: still present: {', '.join(left)}")
        return 0 if not left else 1
    if not lab.state().get("complete"):
        print("lanebench: error: the lab is not up. Fix: run `lanebench lab up` first", file=sys.stderr)
        return 2
    lab.cut_link() if action == "cut-link" else lab.restore_link()
    print("\n".join(line for line in lab.status()[1] if line.startswith("direct link")))
    return 0


def register_cli(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("lab", help="the host lab: GB300 and a Spark pair as network namespaces (root)",
                       description=__doc__.splitlines()[0])
    p.add_argument("action", choices=ACTIONS, help="up | down | status | cut-link | restore-link")
    p.set_defaults(func=lambda args: _run(args.action))


if __name__ == "__main__":
    sys.exit(main())
