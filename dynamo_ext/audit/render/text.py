"""The terminal report (rich tables); ``str(report)`` is the same without colour."""

from __future__ import annotations

import io

from rich import box
from rich.console import Console, Group
from rich.table import Table
from rich.text import Text

from ..model.kinds import BreakKind, RankStatus
from ..model.ranges import format_counts, format_ranks, group_by
from ..model.records import AuditReport, GraphBreak, RankSummary, register_text_renderer

_NONE = "-"


def _ranks(ranks: tuple[int, ...], world: int) -> str:
    return format_ranks(ranks, world_size=world)


def _counts(b: GraphBreak | None, world: int = 0) -> str:
    if b is None:
        return _NONE
    return format_counts(b.count_by_rank, world_size=world)


def _summary(report: AuditReport) -> Table:
    runs = [("stock", report.stock), ("plugin" if report.plugin.get("installed") else "run", report)]
    runs = [(name, r) for name, r in runs if r is not None]
    t = Table(title="Summary (per rank, worst rank)", box=box.SIMPLE_HEAVY, title_justify="left")
    t.add_column("")
    for name, _ in runs:
        t.add_column(name, justify="right")
    rows = [
        ("graph breaks", lambda r: max((x.graph_breaks for x in r.ranks), default=0)),
        ("frame skips", lambda r: max((x.frame_skips for x in r.ranks), default=0)),
        ("  forward", lambda r: sum(1 for b in r.graph_breaks if "forward" in b.phase)),
        ("  backward", lambda r: sum(1 for b in r.graph_breaks if "backward" in b.phase)),
        ("  distributed", lambda r: sum(1 for b in r.graph_breaks if b.distributed)),
        ("graphs", lambda r: max((x.graphs for x in r.ranks), default=0)),
        ("recompiles", lambda r: r.total_recompiles),
        ("compile time (s)", lambda r: f"{max((x.compile_time_s for x in r.ranks), default=0.0):.2f}"),
        ("hang risks", lambda r: len(r.hang_risks)),
        ("ranks ok", lambda r: f"{sum(x.status == 'ok' for x in r.ranks)}/{r.world_size}"),
    ]
    for label, fn in rows:
        t.add_row(label + (" (distinct)" if label.startswith("  ") else ""), *(str(fn(r)) for _, r in runs))
    return t


def _steps(report: AuditReport) -> Table | None:
    """Breaks + frame skips / graphs / recompiles per training step (worst rank), each run a column; ``None``
    when no run counted more than one step (NOTE [steps] in schema/events.py)."""
    runs = [(name, r) for name, r in (("stock", report.stock), ("plugin" if report.plugin.get("installed") else "run",
                                                                  report)) if r is not None]  # fmt: skip
    per = {name: {c.step: c for c in r.steps} for name, r in runs}
    numbers = sorted({n for p in per.values() for n in p})
    if len([n for n in numbers if n > 0]) < 2:
        return None
    t = Table(title="Per training step (worst rank)", box=box.SIMPLE_HEAVY, title_justify="left")
    t.add_column("step", justify="right")
    for name, _ in runs:
        t.add_column(f"{name}: breaks / graphs / recompiles", justify="right")
    for n in numbers:
        cells = []
        for name, _ in runs:
            c = per[name].get(n)
            cells.append(_NONE if c is None else f"{c.graph_breaks + c.frame_skips} / {c.graphs} / {c.recompiles}")
        t.add_row("0 (build)" if n == 0 else str(n), *cells)
    return t


def _breaks(report: AuditReport) -> Table | Text:
    stock = {b.id: b for b in report.stock.graph_breaks} if report.stock else {}
    ids = [b.id for b in report.graph_breaks] + [i for i in stock if i not in {b.id for b in report.graph_breaks}]
    if not ids:
        return Text("No graph breaks.", style="green")
    mine = {b.id: b for b in report.graph_breaks}
    t = Table(title="Graph breaks, by impact", box=box.SIMPLE_HEAVY, title_justify="left", show_lines=True)
    t.add_column("#", justify="right")
    t.add_column("impact", justify="right")
    t.add_column("where", overflow="fold")
    t.add_column("gb_type / fix", overflow="fold", ratio=3)
    t.add_column("ranks")
    if report.stock is not None:
        t.add_column("stock", justify="right")
        t.add_column("plugin", justify="right")
    else:
        t.add_column("count", justify="right")
    t.add_column("phase")
    for n, bid in enumerate(ids, 1):
        b = mine.get(bid) or stock[bid]
        where = Text(f"{b.location}\n{b.function}()\n")
        where.append(b.source, style="cyan")
        what = Text(b.gb_type, style="bold")
        if b.kind == BreakKind.FRAME_SKIP:
            what.append(f"  [frame skipped{': ' + b.wrapper if b.wrapper else ''}]", style="yellow")
        if b.distributed:
            what.append("  [distributed]", style="magenta")
        if b.hang_risk:
            what.append("  [HANG RISK: collectives differ across ranks]", style="bold red")
        elif b.divergent:
            what.append("  [ranks differ; collectives agree]", style="yellow")
        fix = b.fix or (b.hints[0] if b.hints else "")
        if fix:
            what.append(f"\nfix: {fix}")
        w = report.world_size
        counts = (
            [_counts(stock.get(bid), w), _counts(mine.get(bid), w)] if report.stock is not None else [_counts(b, w)]
        )
        t.add_row(str(n), str(b.impact), where, what, _ranks(b.ranks, report.world_size), *counts, b.phase)
    return t


def _recompiles(report: AuditReport) -> Table | None:
    if not report.recompiles:
        return None
    t = Table(title="Recompiles (failed guard, in words)", box=box.SIMPLE_HEAVY, title_justify="left")
    t.add_column("function")
    t.add_column("where")
    t.add_column("reason", overflow="fold", ratio=3)
    t.add_column("ranks")
    t.add_column("count", justify="right")
    t.add_column("steps")
    for r in report.recompiles:
        reason = Text(r.reason)
        if r.why:
            reason.append(f"\nwhy: {r.why}", style="yellow")
        if r.hang_risk:
            reason.append("  [HANG RISK]", style="bold red")
        steps = ", ".join(map(str, r.steps)) or _NONE
        t.add_row(r.function, f"{r.file}:{r.line}", reason, _ranks(r.ranks, report.world_size), str(r.count), steps)
    return t


def _graphs(report: AuditReport) -> Table | None:
    if not report.graphs:
        return None
    t = Table(title="Graphs", box=box.SIMPLE_HEAVY, title_justify="left")
    t.add_column("graph", overflow="fold")
    t.add_column("phase")
    t.add_column("ops", justify="right")
    t.add_column("collectives fwd / bwd", overflow="fold")
    t.add_column("ranks")
    fusions = any(g.fusions for g in report.graphs)
    if fusions:
        t.add_column("fusions applied", overflow="fold")
    for g in report.graphs:
        colls = ", ".join(f"{k}x{v}" for k, v in g.collectives) or _NONE
        bcolls = ", ".join(f"{k}x{v}" for k, v in g.backward_collectives) or _NONE
        ops = str(g.op_count) if len({n for _, n in g.op_count_by_rank}) <= 1 else str(dict(g.op_count_by_rank))
        label = Text(g.id)
        if g.hang_risk:
            label.append("  [HANG RISK]", style="bold red")
        row = [label, g.phase, ops, f"{colls} / {bcolls}", _ranks(g.ranks, report.world_size)]
        if fusions:
            row.append(Text("\n".join(f.describe(g.ranks) for f in g.fusions) or _NONE))  # Text: no markup
        t.add_row(*row)
    return t


def _counter_check(r: RankSummary) -> str:
    if r.dynamo_graph_breaks is None:
        return _NONE
    if r.dynamo_graph_breaks + r.dynamo_missed == r.graph_breaks:
        return "ok" if not r.dynamo_missed else f"ok (Dynamo missed {r.dynamo_missed})"
    return f"MISMATCH ({r.dynamo_graph_breaks})"


def _hosts(rows: list[RankSummary]) -> str:
    hosts = sorted({r.host for r in rows if r.host})
    nodes = sorted({r.node_rank for r in rows if r.node_rank is not None})
    node = f" (node {nodes[0]})" if len(nodes) == 1 else (f" ({len(nodes)} nodes)" if nodes else "")
    if not hosts:
        return "?" + node
    return (hosts[0] if len(hosts) == 1 else f"{len(hosts)} hosts") + node


def _ranks_table(report: AuditReport) -> Table:
    """One row per group of ranks that did the same (ranges), so the outliers stand out by rank and host."""
    t = Table(title="Ranks", box=box.SIMPLE_HEAVY, title_justify="left")
    for c in ("rank", "host", "status", "breaks", "skips", "graphs", "recompiles", "compile s", "counters"):
        t.add_column(c, overflow="fold")
    by_rank = {r.rank: r for r in report.ranks}

    def key(r: RankSummary) -> tuple:
        # Hosts are not part of the key: 1,000 ranks on 125 hosts that agree are one row.
        return (r.status, r.error, r.graph_breaks, r.frame_skips, r.graphs, r.recompiles, _counter_check(r))

    for k, ranks in group_by((r.rank, key(r)) for r in report.ranks):
        rows = [by_rank[x] for x in ranks]
        first = rows[0]
        status = Text(first.status, style="green" if first.status == RankStatus.OK else "bold red")
        if first.error:
            status.append(f": {first.error}", style="red")
        t.add_row(
            format_ranks(ranks),
            _hosts(rows),
            status,
            str(first.graph_breaks),
            str(first.frame_skips),
            str(first.graphs),
            str(first.recompiles),
            f"{max(r.compile_time_s for r in rows):.2f}",
            k[-1],
        )
    return t


def renderables(report: AuditReport) -> Group:
    """Everything the terminal report shows, top to bottom."""
    plugin = report.plugin
    head = Text(f"dynamo-ext audit: {report.target}", style="bold")
    head.append(
        f"\n{report.world_size} rank(s), backend {report.backend or 'as in the target'}, torch {report.torch_version}, "
        f"plugin {'installed' if plugin.get('installed') else 'not installed'}"
        + (" (stock run for comparison)" if report.stock is not None else "")
    )
    if plugin.get("error"):
        head.append(f"\nplugin: {plugin['error']}", style="yellow")
    if plugin.get("installed") and plugin.get("blocks"):
        head.append(f"\nplugin: {plugin['blocks']}")
    for note in report.notes:
        head.append(f"\nnote: {note}", style="yellow")
    parts: list = [head, _summary(report)]
    steps = _steps(report)
    if steps is not None:
        parts.append(steps)
    parts.append(_breaks(report))
    for extra in (_recompiles(report), _graphs(report)):
        if extra is not None:
            parts.append(extra)
    parts.append(_ranks_table(report))
    if report.comm is not None:
        from .comm import comm_renderables

        parts.append(comm_renderables(report.comm))
    num = report.numerics
    if num is not None:
        what = "compiled step vs eager" if num.steps == 1 else f"{num.steps} compiled training steps vs eager"
        own = f"; the target's tolerances: {'; '.join(num.tolerances)}" if num.tolerances else ""
        head = f"Numerics ({what}, same state{own}): {num.compared} tensors per rank, ranks {list(num.ranks)}: "
        if num.mismatches:
            lines = [f"  {m}" for m in num.mismatches[:20]]
            more = len(num.mismatches) - len(lines)
            parts.append(
                Text(
                    head
                    + f"{len(num.mismatches)} MISMATCH(ES); first: {num.first}\n"
                    + "\n".join(lines)
                    + (f"\n  ... {more} more" if more > 0 else ""),
                    style="bold red",
                )
            )
        else:
            parts.append(Text(head + "0 mismatches", style="green"))
    risks = report.hang_risks
    if risks:
        parts.append(
            Text(
                "HANG RISK - collective sequences differ across ranks:\n" + "\n".join(f"  {x}" for x in risks),
                style="bold red",
            )
        )
    if report.stock is not None and report.stock.failures:
        # NOTE [stock failures are findings]: the stock run of --compare-stock is the column compared
        # against; what fails there is what the plugin is for, not a failure of the audit.
        parts.append(
            Text(
                "Stock run (without the plugin) failed; a finding of the stock column, not an error of the audit:\n"
                + "\n".join(f"  stock: {f}" for f in report.stock.failures),
                style="bold yellow",
            )
        )
    if report.errors:
        parts.append(Text("\n".join(f"error: {e}" for e in report.errors), style="bold red"))
    return Group(*parts)


def render_text(report: AuditReport, *, width: int = 120) -> str:
    """The report as plain text (no colour, fixed width)."""
    buf = io.StringIO()
    Console(file=buf, width=width, no_color=True, color_system=None, force_terminal=False, highlight=False).print(
        renderables(report)
    )
    return "\n".join(line.rstrip() for line in buf.getvalue().splitlines()) + "\n"


def print_report(report: AuditReport, console: Console | None = None) -> None:
    """Print the report to the terminal (colour when it is one)."""
    if console is None:
        console = Console(highlight=False)
        if not console.is_terminal:
            console = Console(highlight=False, width=140)
    console.print(renderables(report))


# str(report) is this text (NOTE [report text] in model/records.py).
register_text_renderer(render_text)
