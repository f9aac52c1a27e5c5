"""``dynamo-ext audit merge DIR``: the report of a job that ran ``python -m dynamo_ext.audit.collect --out DIR``.

NOTE [exit status: audit vs audit merge]
Both commands share 0 (passed) and 1 (the gate failed); they differ in what a
rank that did not finish means.  ``dynamo-ext audit`` ran the ranks itself: a
rank that raised, died or hung is the audit's own run failing, exit 2, like bad
input.  ``audit merge`` judges a job someone else ran: its input is fine, the
job is not, so a rank that is missing from DIR, whose file was cut short
(killed), or that raised or was stopped fails the gate, exit 1, with one line
per such rank naming its host.  ``audit merge`` exits 2 only for bad input (no
such directory, no rank files, an unreadable ``--baseline``).
"""

from __future__ import annotations

import argparse
import sys

from rich.console import Console

from .diff import add_gate_arguments, gate_from_arguments, read_gate_arguments

EXIT_OK, EXIT_GATE, EXIT_ERROR = 0, 1, 2


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="dynamo-ext audit merge",
        description="Merge the rank files of a job run under 'python -m dynamo_ext.audit.collect --out DIR' "
        "(torchrun, srun, ...) into one report, or read a directory of TORCH_TRACE logs.",
        epilog="Exit status: 0 passed; 1 the gate failed: a rank missing from DIR, cut short (killed), raised or "
        "stopped, or a budget, the baseline, a hang risk or the numerics check; 2 bad input (no such directory, no "
        "rank files, unreadable --baseline). (dynamo-ext audit, which launches the ranks itself, exits 2 when a "
        "rank raised, died or hung: there it is the audit's own run that failed.)",
    )
    p.add_argument("directory", metavar="DIR", help="the --out directory of the collect runs, or a TORCH_TRACE dir")
    p.add_argument("--json", metavar="FILE", help="write the JSON report (schema: docs/audit.md)")
    p.add_argument("--html", metavar="FILE", help="write a single-file HTML report")
    add_gate_arguments(p)
    p.add_argument(
        "--world-size", type=int, default=None, metavar="N", help="ranks expected (default: from the rank files)"
    )
    p.add_argument("--quiet", action="store_true", help="no terminal report (files and exit status only)")
    return p


def main(argv: list[str]) -> int:
    """Run ``dynamo-ext audit merge``; returns the exit status (NOTE [exit status: audit vs audit merge])."""
    args = _parser().parse_args(argv)
    err = Console(stderr=True, highlight=False)

    def fail(msg: str) -> int:
        err.print(f"dynamo-ext audit merge: error: {msg}", markup=False, soft_wrap=True)
        return EXIT_ERROR

    if args.world_size is not None and args.world_size < 1:
        return fail(f"--world-size must be at least 1, got {args.world_size}")
    from .cli import _write
    from .rank_files import incomplete_ranks, merge_dir
    from .render import print_report

    baseline, why = read_gate_arguments(args)
    if why:
        return fail(why)
    try:
        report = merge_dir(args.directory, world_size=args.world_size)
    except (OSError, ValueError) as e:
        return fail(str(e))
    _write(report, args, err)
    if not args.quiet:
        print_report(report)
    problems = [*report.errors, *incomplete_ranks(report)]
    problems += gate_from_arguments(report, args, baseline)
    for p in problems:
        err.print(f"dynamo-ext audit merge: gate: {p}", markup=False, soft_wrap=True)
    return EXIT_GATE if problems else EXIT_OK


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
