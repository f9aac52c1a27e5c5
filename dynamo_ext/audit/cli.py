"""``dynamo-ext audit [options] [TARGET] [-- ARGS...]``, ``dynamo-ext audit merge DIR`` and ``dynamo-ext audit diff OLD.json NEW.json``.

Exit status: 0 when the run finished and passed the gate; 1 when a budget
(``--max-breaks``, ``--max-recompiles``, ``--max-hang-risks``) is exceeded,
``--check-numerics`` found a tensor that differs between the compiled and the
eager step, or a break that
``--baseline`` does not have appears; 2 on an error (bad input, a rank that
raised, died or hung).  With ``--compare-stock`` all of this is the plugin
run's: a stock run whose ranks raise (wrong gradients the target's own check
caught, a crash) is a finding of the stock column, printed and kept in the
JSON's ``stock.errors``, not an error (NOTE [stock failures are findings] in
:mod:`.render.text`).  Reports asked for with ``--json``/``--html`` are written
in every case, with whatever was collected.  ``audit merge`` exits 1, not 2,
for ranks that did not finish (NOTE [exit status: audit vs audit merge]).

NOTE [exit status: audit vs audit merge]
Both commands share 0 (passed) and 1 (the gate failed); they differ in what a
rank that did not finish means.  ``dynamo-ext audit`` ran the ranks itself: a
rank that raised, died or hung is the audit's own run failing, exit 2, like bad
input.  ``audit merge`` judges a job someone else ran: its input is fine, the
job is not, so a rank that is missing from DIR, whose file was cut short
(killed), or that raised or was stopped fails the gate, exit 1, with one line
per such rank naming its host.  ``audit merge`` exits 2 only for bad input (no
such directory, no rank files, a rank file of another format version, an
unreadable ``--baseline``).

The commands are one argparse tree (:func:`parser`): ``dynamo-ext audit``
with the subcommands ``run`` (the default: ``dynamo-ext audit train.py`` is
``dynamo-ext audit run train.py``), ``merge`` and ``diff``.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import logging
import os
import sys
import warnings
from typing import Any

from rich.console import Console

from .gate.diff import add_gate_arguments, gate_from_arguments, read_gate_arguments

logger = logging.getLogger(__name__)

EXIT_OK, EXIT_GATE, EXIT_ERROR = 0, 1, 2
DEFAULT_TARGET = "dynamo_ext.audit.targets.example_llama:main"
SUBCOMMANDS = ("run", "merge", "diff")
BACKENDS = ("eager", "aot_eager", "inductor")


def parser() -> argparse.ArgumentParser:
    """The command tree: ``dynamo-ext audit {run,merge,diff}``; :func:`main` picks ``run`` when no subcommand is named."""
    return _tree()[0]


def _tree() -> tuple[argparse.ArgumentParser, dict[str, argparse.ArgumentParser]]:
    top = argparse.ArgumentParser(prog="dynamo-ext")
    commands = top.add_subparsers(dest="command", required=True)
    audit = commands.add_parser("audit", prog="dynamo-ext audit", help="graph breaks and recompiles, merged over ranks")
    sub = audit.add_subparsers(dest="subcommand", required=True)
    return top, {"run": _add_run(sub), "merge": _add_merge(sub), "diff": _add_diff(sub)}


def _subparser(name: str) -> argparse.ArgumentParser:
    """The parser of ``dynamo-ext audit NAME`` (one of :data:`SUBCOMMANDS`) in the tree of :func:`parser`.

    Each subcommand parses its own arguments, so that its errors name it (``dynamo-ext audit merge: error: ...``).
    """
    return _tree()[1][name]


def _add_run(sub: Any) -> argparse.ArgumentParser:
    p = sub.add_parser(
        "run",
        prog="dynamo-ext audit",
        help="launch TARGET on N local ranks and report (the default subcommand)",
        description="Run a distributed program on N local ranks under torch.compile (with dynamo-ext) and report "
        "every graph break and recompile, merged over ranks.",
        epilog="TARGET is a script path, module:function or script.py:function (a function returning a step is "
        "trained --steps steps); without it, the bundled Llama TP+FSDP2 example "
        f"({DEFAULT_TARGET}, 4 ranks). Arguments after -- go to the target. Exit status: 0 passed; 1 the gate failed "
        "(budgets, --baseline, hang risks, numerics); 2 an error: bad input, or a rank raised, died (killed) or hung "
        "past --timeout (the rank is named; --json/--html are still written with what was collected); with "
        "--compare-stock, of the plugin run (a failed stock run is a finding of the stock column). "
        "Also: dynamo-ext audit merge DIR (a job run under python -m dynamo_ext.audit.collect; exits 1 for ranks "
        "that did not finish), dynamo-ext audit diff OLD.json NEW.json",
    )
    p.add_argument("target", nargs="?", default=None, metavar="TARGET")
    p.add_argument(
        "--nproc", type=int, default=None, help="ranks to launch (default: 4 for the bundled example, else 2)"
    )
    p.add_argument("--backend", choices=BACKENDS, default=None, help="override the target's torch.compile backend")
    p.add_argument("--compare-stock", action="store_true", help="also run without the plugin and show both columns")
    p.add_argument("--no-plugin", action="store_true", help="run stock torch only (no dynamo-ext)")
    p.add_argument("--json", metavar="FILE", help="write the JSON report (schema: docs/audit.md)")
    p.add_argument("--html", metavar="FILE", help="write a single-file HTML report")
    add_gate_arguments(p)
    p.add_argument(
        "--check-numerics",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="also run the target's make_step() compiled and eagerly from the same state and compare outputs, "
        "gradients and parameters; exit 1 on a difference (default: on for the bundled example, else off)",
    )
    p.add_argument(
        "--rtol",
        type=float,
        default=None,
        help="numerics tolerance (with --atol; default: torch.testing.assert_close's per dtype)",
    )
    p.add_argument("--atol", type=float, default=None, help="numerics tolerance (with --rtol)")
    p.add_argument(
        "--steps",
        type=int,
        default=None,
        metavar="N",
        help="training steps the audit runs of a TARGET function that returns a step, such as pkg.train:make_step "
        "(default 3; a target that runs its own loop runs its own steps)",
    )
    p.add_argument(
        "--intra-node-bw",
        type=float,
        default=None,
        metavar="GBPS",
        help="intra-node bandwidth (GB/s) for the collectives' time estimates (default: comm_analysis's)",
    )
    p.add_argument(
        "--inter-node-bw",
        type=float,
        default=None,
        metavar="GBPS",
        help="inter-node bandwidth (GB/s) for the collectives' time estimates (default: comm_analysis's)",
    )
    p.add_argument(
        "--timeout", type=float, default=300.0, metavar="S", help="kill the ranks after S seconds (default 300)"
    )
    p.add_argument("--keep-logs", action="store_true", help="keep the per-rank logs (kept anyway on errors)")
    p.add_argument("--quiet", action="store_true", help="no terminal report (files and exit status only)")
    return p


def _add_merge(sub: Any) -> argparse.ArgumentParser:
    p = sub.add_parser(
        "merge",
        prog="dynamo-ext audit merge",
        help="merge the rank files of a job run under python -m dynamo_ext.audit.collect",
        description="Merge the rank files of a job run under 'python -m dynamo_ext.audit.collect --out DIR' "
        "(torchrun, srun, ...) into one report, or read a directory of TORCH_TRACE logs.",
        epilog="Exit status: 0 passed; 1 the gate failed: a rank missing from DIR, cut short (killed), raised or "
        "stopped, or a budget, the baseline, a hang risk or the numerics check; 2 bad input (no such directory, no "
        "rank files, a rank file of another format version, unreadable --baseline). (dynamo-ext audit, which launches the ranks itself, exits 2 when a "
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


def _add_diff(sub: Any) -> argparse.ArgumentParser:
    p = sub.add_parser(
        "diff",
        prog="dynamo-ext audit diff",
        help="new, fixed and unchanged graph breaks between two JSON reports",
        description="New, fixed and unchanged graph breaks.",
    )
    p.add_argument("old", metavar="OLD.json")
    p.add_argument("new", metavar="NEW.json")
    p.add_argument("--fail-on-new", action="store_true", help="exit 1 when NEW has a break OLD lacks")
    return p


def _validate_target(target: str) -> str | None:
    """Why ``target`` cannot run, in one line, or ``None``."""
    from .rank.target import is_function_target, resolve_function, script_defines, script_function

    script = script_function(target)
    if script is not None:
        return script_defines(*script)
    if is_function_target(target):
        module, _, func = target.partition(":")
        try:
            spec = importlib.util.find_spec(module)
        except (ImportError, ValueError):
            spec = None
        if spec is None:
            return f"unknown module {module!r} in target {target!r} (expected a script path or module:function)"
        try:
            fn = resolve_function(target)
        except AttributeError:
            return f"module {module!r} has no function {func!r} (target {target!r})"
        except Exception as e:
            return f"importing {module!r} for target {target!r} failed: {type(e).__name__}: {e}"
        if not callable(fn):
            return f"{target!r} is not callable"
        return None
    if not os.path.isfile(target):
        return f"target not found: {target!r} is neither a file nor module:function"
    return None


def _bad_option(args: argparse.Namespace) -> str | None:
    """Why an option cannot work, in one line, checked before any rank starts, or ``None``."""
    for flag in ("max_breaks", "max_recompiles", "max_hang_risks"):
        value = getattr(args, flag, None)
        if value is not None and value < 0:
            return f"--{flag.replace('_', '-')} must be 0 or more, got {value}"
    for flag in ("rtol", "atol"):
        value = getattr(args, flag)
        if value is not None and not value >= 0:
            return f"--{flag} must be a number >= 0, got {value:g}"
    for flag in ("json", "html"):
        path = getattr(args, flag)
        if path:
            folder = os.path.dirname(os.path.abspath(path))
            if os.path.isdir(path):
                return f"--{flag} {path}: is a directory; give a file name"
            if not os.path.isdir(folder):
                return f"--{flag} {path}: folder {folder} does not exist"
    return None


def _write(report, args: argparse.Namespace, err: Console) -> None:  # type: ignore[no-untyped-def]
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(report.to_json(), f, indent=1, default=str)
    if args.html:
        from .render.html import render_html

        with open(args.html, "w", encoding="utf-8") as f:
            f.write(render_html(report))


def _audit(argv: list[str]) -> int:
    target_args: list[str] = []
    if "--" in argv:
        i = argv.index("--")
        argv, target_args = argv[:i], argv[i + 1 :]
    args = _subparser("run").parse_args(argv)
    err = Console(stderr=True, highlight=False)

    def fail(msg: str) -> int:
        err.print(f"dynamo-ext audit: error: {msg}", markup=False, soft_wrap=True)
        return EXIT_ERROR

    target = args.target or DEFAULT_TARGET
    nproc = args.nproc or (4 if args.target is None else 2)
    if nproc < 1:
        return fail(f"--nproc must be at least 1, got {nproc}")
    if args.timeout <= 0:
        return fail(f"--timeout must be positive, got {args.timeout:g}")
    if args.steps is not None and args.steps < 1:
        return fail(f"--steps must be at least 1, got {args.steps}")
    if (args.rtol is None) != (args.atol is None):
        return fail("give --rtol and --atol together (or neither, for torch.testing.assert_close's defaults)")
    why = _bad_option(args)
    if why:
        return fail(why)
    check_numerics = args.check_numerics if args.check_numerics is not None else args.target is None
    if args.compare_stock and args.no_plugin:
        return fail("--compare-stock already runs without the plugin; drop --no-plugin")
    baseline, why = read_gate_arguments(args)
    if why:
        return fail(why)
    for flag, bw in (("--intra-node-bw", args.intra_node_bw), ("--inter-node-bw", args.inter_node_bw)):
        if bw is not None and not bw > 0:
            return fail(f"{flag} must be a positive bandwidth in GB/s, got {bw:g}")
    from .rank.comm import INTER_BW_ENV, INTRA_BW_ENV

    # Read by each rank's communication report (the ranks inherit the environment).
    for env, bw in ((INTRA_BW_ENV, args.intra_node_bw), (INTER_BW_ENV, args.inter_node_bw)):
        if bw is not None:
            os.environ[env] = repr(bw)
    why = _validate_target(target)
    if why:
        return fail(why)

    from .launch import run_ranks
    from .render.text import print_report

    runs = (
        [("stock", False)]
        if args.no_plugin
        else ([("stock", False), ("plugin", True)] if args.compare_stock else [("plugin", True)])
    )
    reports = {}
    for label, plugin in runs:
        with err.status(f"[{label}] starting {nproc} rank(s) of {target} ...") as status:

            def show(progress, label=label, status=status):  # type: ignore[no-untyped-def]
                parts = []
                for r, p in sorted(progress.items()):
                    state = "done" if p.done else ("FAILED" if p.failed else ("running" if p.started else "starting"))
                    parts.append(f"r{r} {state} {p.graphs}g {p.breaks}b {p.recompiles}rc")
                status.update(f"[{label}] " + " | ".join(parts))

            reports[label] = run_ranks(
                target, target_args, nproc=nproc, backend=args.backend, plugin=plugin, timeout=args.timeout,
                on_progress=show, keep_logs=args.keep_logs,
                # The numerics check runs with the plugin (the stock run of --compare-stock is for counts).
                check_numerics=check_numerics and (plugin or args.no_plugin), rtol=args.rtol, atol=args.atol,
                steps=args.steps,
            )  # fmt: skip
    import dataclasses

    report = reports.get("plugin") or reports["stock"]
    if "plugin" in reports and "stock" in reports:
        report = dataclasses.replace(reports["plugin"], stock=reports["stock"])
    _write(report, args, err)
    if not args.quiet:
        print_report(report)
    if report.stock is not None and report.stock.failures:
        # NOTE [stock failures are findings] (render/text.py): the exit status is the plugin run's.
        logs = sorted({r.log for r in report.stock.ranks if r.log})
        suffix = f"; its rank logs under {os.path.commonpath(logs)}" if logs else ""
        err.print(
            f"dynamo-ext audit: stock run (a finding, not an error): {report.stock.failures[0]}{suffix}",
            markup=False,
            soft_wrap=True,
        )
    if report.errors:
        logs = sorted({r.log for r in report.ranks if r.log})
        suffix = f"; rank logs under {os.path.commonpath(logs)}" if logs else ""
        return fail(report.errors[0] + suffix)
    problems = gate_from_arguments(report, args, baseline)
    for p in problems:
        err.print(f"dynamo-ext audit: gate: {p}", markup=False, soft_wrap=True)
    return EXIT_GATE if problems else EXIT_OK


def _merge(argv: list[str]) -> int:
    """Run ``dynamo-ext audit merge``; returns the exit status (NOTE [exit status: audit vs audit merge])."""
    args = _subparser("merge").parse_args(argv)
    err = Console(stderr=True, highlight=False)

    def fail(msg: str) -> int:
        err.print(f"dynamo-ext audit merge: error: {msg}", markup=False, soft_wrap=True)
        return EXIT_ERROR

    if args.world_size is not None and args.world_size < 1:
        return fail(f"--world-size must be at least 1, got {args.world_size}")
    from .merge.rank_files import incomplete_ranks, merge_dir
    from .render.text import print_report

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


def _diff(argv: list[str]) -> int:
    args = _subparser("diff").parse_args(argv)
    from .gate.diff import diff_reports
    from .model.io import load_report

    try:
        old, new = load_report(args.old), load_report(args.new)
    except (OSError, ValueError) as e:
        print(f"dynamo-ext audit diff: error: {e}", file=sys.stderr)
        return EXIT_ERROR
    d = diff_reports(old, new)
    sys.stdout.write(str(d))
    return EXIT_GATE if args.fail_on_new and d.new else EXIT_OK


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``dynamo-ext`` command.

    The terminal gets the audit's own lines only.  The ranks' output, library
    warnings included, goes to the per-rank logs (``launch.py``); warnings raised
    in this process (importing torch, or a ``module:function`` target to check
    it) are not printed where they happen but summarised in one line at the end
    and logged in full (logger ``dynamo_ext.audit.cli``, level INFO).  With
    ``-W``/``PYTHONWARNINGS`` set, Python's own warning handling is left alone.
    """
    argv = list(sys.argv[1:] if argv is None else argv)
    if sys.warnoptions:
        return _main(argv)
    with warnings.catch_warnings(record=True) as caught:
        code = _main(argv)
    if caught:
        for w in caught:
            logger.info("%s", warnings.formatwarning(w.message, w.category, w.filename, w.lineno, w.line).rstrip())
        print(warning_summary(caught), file=sys.stderr)
    return code


def warning_summary(caught: list[warnings.WarningMessage]) -> str:
    """One stderr line for the warnings this process caught: the first one, and how many more."""
    first = caught[0]
    text = " ".join(str(first.message).split())
    text = text if len(text) <= 160 else text[:157] + "..."
    more = f"; {len(caught) - 1} more" if len(caught) > 1 else ""
    return (
        f"dynamo-ext audit: note: library warning, not shown where raised: {first.category.__name__}: {text} "
        f"({os.path.basename(first.filename)}:{first.lineno}){more}; python -W default shows them"
    )


def _main(argv: list[str]) -> int:
    if not argv or argv[0] in ("-h", "--help"):
        print("usage: dynamo-ext audit [options] [TARGET] [-- ARGS...]\n       dynamo-ext audit merge [options] DIR\n"
              "       dynamo-ext audit diff OLD.json NEW.json\n\n"
              "Run 'dynamo-ext audit --help' for the options.")  # fmt: skip
        return EXIT_OK if argv else EXIT_ERROR
    if argv[0] != "audit":
        print(
            f"dynamo-ext: error: unknown command {argv[0]!r}; the command is 'audit' (or 'audit diff')", file=sys.stderr
        )
        return EXIT_ERROR
    if len(argv) > 1 and argv[1] == "diff":
        return _diff(argv[2:])
    if len(argv) > 1 and argv[1] == "merge":
        return _merge(argv[2:])
    return _audit(argv[2:] if len(argv) > 1 and argv[1] == "run" else argv[1:])
