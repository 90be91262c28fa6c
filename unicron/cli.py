"""The ``unicron`` command: one sub-command per module, dispatched here.

Each command module exposes ``add_arguments(parser)`` and ``main(args) -> int`` (or, for
``module:prefix``, ``add_PREFIX_arguments`` and ``PREFIX_main``) and is imported only when its
command runs, so ``unicron plan`` never pays for ``import torch``.
A :class:`~unicron.errors.UsageError` from any of them becomes one line on stderr and
exit code 2; exit 0 means the task finished, 1 that it failed for good.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence

from unicron.errors import UsageError

# command name -> (module, one-line help)
COMMANDS: dict[str, tuple[str, str]] = {
    "run": ("unicron.control.runner", "train a script on this machine, self-healing"),
    "coordinator": ("unicron.control.service", "the cluster service (HTTP API, state, store)"),
    "agent": ("unicron.control.node", "a node's agent: runs the workers the cluster places"),
    "submit": ("unicron.control.client:submit", "submit a task file to the cluster"),
    "status": ("unicron.control.client:status", "nodes and tasks of the cluster"),
    "cancel": ("unicron.control.client:cancel", "cancel a task"),
    "logs": ("unicron.control.client:logs", "a task's event log"),
    "report": ("unicron.control.client:report", "a cluster task's healing timeline"),
    "token": ("unicron.control.credentials", "add, rotate, revoke or list cluster credentials"),
    "plan": ("unicron.planner.command", "plan slots and parallel configs for tasks"),
    "simulate": ("unicron.sim.command", "trace-driven comparison of recovery policies"),
}


class _Parser(argparse.ArgumentParser):
    """argparse that reports bad usage as one line and exit code 2."""

    def error(self, message: str) -> None:  # type: ignore[override]
        raise UsageError(f"{self.prog}: {message}")


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """The parser; only ``command``'s module is imported to add its arguments."""
    parser = _Parser(prog="unicron", description="Self-healing LLM training (Unicron).")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
    sub.required = True
    for name, (module, help_text) in COMMANDS.items():
        p = sub.add_parser(name, help=help_text, description=help_text)
        if name == command:
            mod, _, prefix = module.partition(":")
            add = f"add_{prefix}_arguments" if prefix else "add_arguments"
            getattr(importlib.import_module(mod), add)(p)
        p.set_defaults(_module=module)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    command = next((a for a in argv if not a.startswith("-")), None)
    try:
        args = build_parser(command).parse_args(argv)
        mod, _, prefix = args._module.partition(":")
        run = getattr(importlib.import_module(mod), f"{prefix}_main" if prefix else "main")
        return int(run(args))
    except UsageError as exc:
        print(f"unicron: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
