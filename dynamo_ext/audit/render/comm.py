"""The communication report's terminal tables and HTML section (:class:`.records.Comm`)."""

from __future__ import annotations

from html import escape

from rich import box
from rich.console import Group
from rich.table import Table
from rich.text import Text

from ..model.records import Collective, Comm


def human_bytes(n: float) -> str:
    """``1536`` -> ``"1.5 KiB"`` (binary units)."""
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GiB"


def runs(comm: Comm) -> list[tuple[Collective, int]]:
    """Collectives to show, consecutive identical ones (same graph, op, group, bytes, line, module) as one row with a count.

    Inlined AOT backward graphs (compiled autograd runs their copy) are left out.
    """
    out: list[tuple[Collective, int]] = []
    for c in comm.collectives:
        if c.inlined:
            continue
        key = (c.graph, c.graph_kind, c.op, c.group, c.bytes_in, c.file, c.line, c.module, c.placements_before)
        if out:
            p, n = out[-1]
            if (p.graph, p.graph_kind, p.op, p.group, p.bytes_in, p.file, p.line, p.module, p.placements_before) == key:
                out[-1] = (p, n + 1)
                continue
        out.append((c, 1))
    return out


def _axis(c: Collective) -> str:
    return f"{c.mesh_axis or 'pg ' + c.group}({c.group_size})"


def _why(c: Collective, alts: dict[str, int] | None = None) -> str:
    if c.origin != "dtensor":
        return c.origin
    out = f"{_one(c.placements_before)}->{_one(c.placements_after)}"
    if c.alternative and alts is not None:
        out = f"[a{alts.setdefault(c.alternative, len(alts) + 1)}] {out}"
    elif c.alternative:
        out += f"; alternative ({c.alternative_basis}): {c.alternative}"
    return out


_MIN_WIDTH = {"graph": 6, "op": 14, "axis": 5, "sent": 8, "est us": 6, "ovl": 3, "line": 20, "origin": 14}
_MAX_WIDTH = {"line": 22, "module": 17, "origin": 19}


def _one(placements: str) -> str:
    """``(P(sum))`` -> ``P(sum)``: a 1-D mesh's placements without the tuple's parentheses."""
    inner = placements[1:-1] if placements.startswith("(") and placements.endswith(")") else placements
    return inner if inner and "," not in inner else placements


def _short_op(op: str) -> str:
    return op.replace("_into_tensor", "").replace("_tensor", "")


def counts_line(comm: Comm) -> tuple[str, bool | None]:
    """The compiled like-with-like counts vs eager ``CommDebugMode``'s, in words, with the reasons for each difference.

    Returns the text and whether every count agrees or has a reason (``None``: no eager count); a
    difference no reason covers is a MISMATCH (NOTE [count differences] in ``comm_explain.py``).
    """
    mine = ", ".join(f"{ph} {k} {n}" for ph, k, n in comm.counts) or "none"
    if comm.eager_counts is None:
        return f"collectives (FSDP2 per group): {mine}; eager CommDebugMode: not run (--check-numerics runs it)", None
    if tuple(comm.counts) == tuple(comm.eager_counts):
        return f"collectives (FSDP2 per group): {mine}; eager CommDebugMode: the same", True
    theirs = ", ".join(f"{ph} {k} {n}" for ph, k, n in comm.eager_counts) or "none"
    diffs = comm.count_differences
    ok = bool(diffs) and not any(d.unexplained for d in diffs)
    lines = [
        f"collectives (FSDP2 per group): {mine}; eager CommDebugMode: {theirs} - "
        + ("differs, for these reasons:" if ok else "MISMATCH")
    ]
    for d in diffs:
        lines.append(f"  {d.phase} {d.kind}: compiled {d.compiled}, eager {d.eager}")
        lines += [f"    {r}" for r in d.reasons]
        if d.unexplained:
            lines.append(f"    unexplained: {d.unexplained}: {UNEXPLAINED}")
    return "\n".join(lines), ok


UNEXPLAINED = (
    "the compiled step issues other collectives here than the eager step; the collectives table above (line, origin, "
    "placements) and CommDebugMode on the eager step (torch.distributed.tensor.debug) show which, and "
    "--check-numerics whether the values still agree"
)
LATER_STEPS = (
    "Graphs compiled after the first step (recompiles; listed above, not in the totals or counts, which are the first "
    "step's):"
)


def comm_renderables(comm: Comm) -> Group:
    """Terminal tables: every collective (runs of identical ones as one row), totals per module, the step's totals."""
    t = Table(
        title="Communication: collectives of the compiled graphs in graph order (fwd/bwd: AOTAutograd's, ca: compiled "
        "autograd's; xN: N identical consecutive ones; sent: bytes per rank; ovl: compute ops before its wait; source lines in the JSON and HTML)",
        box=box.SIMPLE_HEAVY,
        title_justify="left",
    )
    right = ("sent", "est us", "ovl")
    for col in ("graph", "op", "axis", "sent", "est us", "ovl", "line", "module", "origin"):
        t.add_column(
            col,
            justify="right" if col in right else "left",
            no_wrap=True,
            overflow="ellipsis",
            min_width=_MIN_WIDTH.get(col),
            max_width=_MAX_WIDTH.get(col),
        )
    alts: dict[str, int] = {}
    for c, n in runs(comm):
        where = f"{c.file.rsplit('/', 1)[-1]}:{c.line}" if c.file else "-"
        cells = (
            {"compiled_autograd": "ca", "forward": "fwd", "backward": "bwd"}.get(c.graph_kind, c.graph_kind)
            + (f" x{n}" if n > 1 else ""),
            _short_op(c.op),
            _axis(c),
            human_bytes(c.sent),
            "-" if c.est_ms is None else f"{c.est_ms * 1000:.1f}",
            "-" if c.overlap_ops is None else str(c.overlap_ops),
            where,
            c.module or "-",
            _why(c, alts),
        )
        t.add_row(*(Text(x) for x in cells))  # Text: source lines and "[a1]" are not rich markup
    m = Table(title="Communication per module", box=box.SIMPLE_HEAVY, title_justify="left")
    for col in ("module", "phase", "collectives", "sent / rank", "est us"):
        m.add_column(col, justify="left" if col in ("module", "phase") else "right")
    for x in comm.modules:
        m.add_row(*(Text(v) for v in (x.module, x.phase, str(x.count), human_bytes(x.sent), f"{x.est_ms * 1000:.1f}")))
    line, ok = counts_line(comm)
    inlined = sum(c.inlined for c in comm.collectives)
    foot = Text(
        f"Per step (each compiled graph once): {human_bytes(comm.bytes_per_step)} sent per rank (worst rank), "
        f"estimated {comm.est_ms_per_step * 1000:.1f} us of NCCL time (torch._inductor.comm_analysis)"
        + (
            f"; {inlined} collectives of AOT backward graphs inlined by compiled autograd not counted"
            if inlined
            else ""
        )
        + f"\n{line}",
        style="bold red" if ok is False else "",
    )
    notes = Text(
        "\n".join(f"[a{i}] alternative (heuristic, not verified by sharding propagation): {a}" for a, i in alts.items())
    )
    parts = [t, notes, m, foot] if alts else [t, m, foot]
    if comm.later_steps:
        parts.append(Text(LATER_STEPS + "\n" + "\n".join(f"  {x}" for x in comm.later_steps)))
    if comm.missing:
        parts.append(
            Text("INCOMPLETE communication report:\n" + "\n".join(f"  {x}" for x in comm.missing), style="bold red")
        )
    return Group(*parts)


def comm_html(comm: Comm) -> str:
    """The HTML section: the totals, a sortable table of every collective and one of the per-module totals."""
    line, ok = counts_line(comm)
    rows = "".join(
        f"<tr><td>{escape(c.graph_kind)}</td><td>{escape(c.graph)}</td><td class='num'>{c.index}</td>"
        f"<td>{escape(c.op)}</td><td>{escape(_axis(c))}</td><td class='num'>{c.bytes_in}</td>"
        f"<td class='num'>{c.sent}</td><td class='num'>{'' if c.est_ms is None else f'{c.est_ms * 1000:.1f}'}</td>"
        f"<td class='num'>{'' if c.overlap_ops is None else c.overlap_ops}</td>"
        f"<td>{escape(c.location)}<br><code>{escape(c.source)}</code></td><td>{escape(c.module)}</td>"
        f"<td>{escape(_why(c)).replace(chr(10), '<br>')}</td></tr>"
        for c in comm.collectives
        if not c.inlined
    )
    mods = "".join(
        f"<tr><td>{escape(x.module)}</td><td>{x.phase}</td><td class='num'>{x.count}</td>"
        f"<td class='num'>{x.sent}</td><td class='num'>{x.est_ms * 1000:.1f}</td></tr>"
        for x in comm.modules
    )
    missing = "".join(f"<p class='bad'>incomplete: {escape(x)}</p>" for x in comm.missing)
    if comm.later_steps:
        missing += f"<p>{escape(LATER_STEPS)}<br>" + "<br>".join(escape(x) for x in comm.later_steps) + "</p>"
    return (
        f"<h2>Communication</h2>{missing}<p id='comm-totals'>Per step (each compiled graph once): <b>{comm.bytes_per_step}</b> "
        f"bytes sent per rank (worst rank), estimated <b>{comm.est_ms_per_step * 1000:.1f} us</b> "
        f"(torch._inductor.comm_analysis).</p><p class='{'bad' if ok is False else 'ok'}'>"
        f"{escape(line).replace(chr(10), '<br>')}</p>"
        "<table id='comm'><thead><tr><th>graph</th><th>graph id</th><th>#</th><th>op</th><th>mesh axis</th>"
        "<th>bytes in</th><th>bytes sent</th><th>est us</th><th>overlap ops</th><th>line</th><th>module</th>"
        f"<th>origin / placements</th></tr></thead><tbody>{rows}</tbody></table>"
        "<h3>Per module</h3><table id='comm-modules'><thead><tr><th>module</th><th>phase</th><th>collectives</th>"
        f"<th>bytes sent</th><th>est us</th></tr></thead><tbody>{mods}</tbody></table>"
    )
