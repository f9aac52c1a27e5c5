"""A single-file HTML report: sortable tables, source snippets, a per-rank view.

No external resources (CSS and JS are inline), so the file opens offline and
in CI artifacts.  Row markup is stable for tests: ``tr.break-row`` per merged
graph break (``data-ranks`` lists its ranks), ``tr.recompile-row``,
``tr.graph-row``, ``tr.rank-row``.
"""

from __future__ import annotations

from html import escape

from ..model.kinds import BreakKind, RankStatus
from ..model.ranges import format_counts, format_ranks
from ..model.records import AuditReport, GraphBreak

_CSS = """
body{font:14px system-ui,sans-serif;margin:1.5em;color:#222}
h1{font-size:1.4em}h2{font-size:1.15em;margin-top:1.6em}
table{border-collapse:collapse;width:100%;margin:.5em 0}
th,td{border:1px solid #ccc;padding:4px 6px;vertical-align:top;text-align:left}
th{background:#f0f0f0;cursor:pointer;user-select:none}th.sorted-asc:after{content:" \\25B2"}th.sorted-desc:after{content:" \\25BC"}
td.num{text-align:right}code,pre{font:12px ui-monospace,monospace}pre{background:#f7f7f7;padding:6px;margin:4px 0;overflow:auto}
.hl{background:#fff3b0;display:block}.risk{color:#b00;font-weight:bold}.dist{color:#806;font-weight:bold}.skip{color:#a60}
.bad{color:#b00;font-weight:bold}.ok{color:#070}.hidden{display:none}.meta{color:#555}
"""

_JS = """
function sortTable(th){
  const table=th.closest('table'), idx=[...th.parentNode.children].indexOf(th);
  const asc=!th.classList.contains('sorted-asc');
  table.querySelectorAll('th').forEach(h=>h.classList.remove('sorted-asc','sorted-desc'));
  th.classList.add(asc?'sorted-asc':'sorted-desc');
  const body=table.tBodies[0], rows=[...body.rows];
  const key=r=>{const c=r.cells[idx]; const v=c.dataset.sort!==undefined?c.dataset.sort:c.textContent.trim();
    const n=parseFloat(v); return isNaN(n)?v.toLowerCase():n;};
  rows.sort((a,b)=>{const x=key(a),y=key(b); return (x<y?-1:x>y?1:0)*(asc?1:-1);});
  rows.forEach(r=>body.appendChild(r));
}
function showRank(v){
  document.querySelectorAll('tr[data-ranks]').forEach(r=>{
    const ranks=r.dataset.ranks.split(',');
    r.classList.toggle('hidden', v!=='all' && !ranks.includes(v));
  });
}
document.addEventListener('DOMContentLoaded',()=>{
  document.querySelectorAll('th').forEach(th=>th.addEventListener('click',()=>sortTable(th)));
  document.body.dataset.breakRows=document.querySelectorAll('tr.break-row').length;
});
"""


def _snippet(b: GraphBreak) -> str:
    if not b.snippet:
        return f"<pre>{escape(b.source)}</pre>"
    lines = []
    for n, text in b.snippet:
        cls = ' class="hl"' if n == b.line else ""
        lines.append(f"<span{cls}>{n:5d}  {escape(text)}</span>")
    return "<pre>" + "\n".join(lines) + "</pre>"


def _counts(b: GraphBreak | None) -> tuple[str, str]:
    if b is None:
        return "0", "-"
    return str(b.count), format_counts(b.count_by_rank)


def _break_rows(report: AuditReport) -> list[str]:
    stock = {b.id: b for b in report.stock.graph_breaks} if report.stock else {}
    mine = {b.id: b for b in report.graph_breaks}
    ids = list(mine) + [i for i in stock if i not in mine]
    rows = []
    for n, bid in enumerate(ids, 1):
        b = mine.get(bid) or stock[bid]
        tags = []
        if b.kind == BreakKind.FRAME_SKIP:
            tags.append(f'<span class="skip">frame skipped{": " + escape(b.wrapper) if b.wrapper else ""}</span>')
        if b.distributed:
            tags.append('<span class="dist">distributed</span>')
        if b.hang_risk:
            tags.append('<span class="risk">HANG RISK: ranks diverge</span>')
        stack = "\n".join(f"{escape(f.file)}:{f.line} in {escape(f.function)}\n    {escape(f.source)}" for f in b.stack)
        hints = "".join(f"<li>{escape(h)}</li>" for h in b.hints)
        if report.stock is not None:
            count_cells = (
                f'<td class="num">{_counts(stock.get(bid))[0]}</td><td class="num">{_counts(mine.get(bid))[0]}</td>'
            )
        else:
            c, per = _counts(b)
            count_cells = f'<td class="num" data-sort="{c}">{c}<br><span class="meta">{escape(per)}</span></td>'
        rows.append(
            f'<tr class="break-row" data-id="{escape(bid)}" data-ranks="{",".join(map(str, b.ranks))}">'
            f'<td class="num">{n}</td><td class="num">{b.impact}</td>'
            f'<td data-sort="{escape(b.location)}"><code>{escape(b.location)}</code><br>{escape(b.function)}()'
            f"<details><summary>source</summary>{_snippet(b)}</details>"
            f"<details><summary>stack</summary><pre>{stack}</pre></details></td>"
            f"<td><b>{escape(b.gb_type)}</b> {' '.join(tags)}<br>{escape(b.explanation)}"
            + (f"<br><b>fix:</b> {escape(b.fix)}" if b.fix else "")
            + (f"<details><summary>Dynamo hints</summary><ul>{hints}</ul></details>" if hints else "")
            + f"</td><td>{escape(format_ranks(b.ranks))}</td>{count_cells}<td>{escape(b.phase)}</td></tr>"
        )
    return rows


def render_html(report: AuditReport) -> str:
    """The whole report as one HTML document."""
    title = f"dynamo-ext audit: {report.target}"
    plugin = "installed" if report.plugin.get("installed") else "not installed"
    if report.plugin.get("installed") and report.plugin.get("blocks"):
        plugin += f" ({escape(str(report.plugin['blocks']))})"
    risks = report.hang_risks
    rank_opts = "".join(f'<option value="{r.rank}">rank {r.rank}</option>' for r in report.ranks)
    count_heads = "<th>stock</th><th>plugin</th>" if report.stock is not None else "<th>count</th>"
    breaks = _break_rows(report)
    recompiles = [
        f'<tr class="recompile-row" data-ranks="{",".join(map(str, r.ranks))}"><td>{escape(r.function)}</td>'
        f"<td><code>{escape(r.file)}:{r.line}</code></td><td>{escape(r.reason)}"
        + (' <span class="risk">HANG RISK</span>' if r.hang_risk else "")
        + f'</td><td>{format_ranks(r.ranks)}</td><td class="num">{r.count}</td></tr>'
        for r in report.recompiles
    ]
    fusions = any(g.fusions for g in report.graphs)
    graphs = [
        f'<tr class="graph-row" data-ranks="{",".join(map(str, g.ranks))}"><td><code>{escape(g.id)}</code>'
        + (' <span class="risk">HANG RISK</span>' if g.hang_risk else "")
        + f'</td><td>{g.phase}</td><td class="num">{g.op_count}</td>'
        f"<td>{escape(', '.join(f'{k} x{v}' for k, v in g.collectives)) or '-'}</td>"
        f"<td>{escape(', '.join(f'{k} x{v}' for k, v in g.backward_collectives)) or '-'}</td>"
        f'<td>{format_ranks(g.ranks)}</td><td class="num">{g.compile_time_s:.2f}</td>'
        + (f"<td>{'<br>'.join(escape(f.describe(g.ranks)) for f in g.fusions) or '-'}</td>" if fusions else "")
        + "</tr>"
        for g in report.graphs
    ]
    ranks = [
        f'<tr class="rank-row"><td class="num">{r.rank}</td><td>{escape(r.host or "?")}'
        + (f" (node {r.node_rank})" if r.node_rank is not None else "")
        + f'</td><td class="{"ok" if r.status == RankStatus.OK else "bad"}">{r.status}</td>'
        f'<td class="num">{r.graph_breaks}</td><td class="num">{r.frame_skips}</td><td class="num">{r.graphs}</td>'
        f'<td class="num">{r.recompiles}</td><td class="num">{r.compile_time_s:.2f}</td>'
        f"<td>{'-' if r.dynamo_graph_breaks is None else r.dynamo_graph_breaks}</td><td>{escape(r.error)}</td></tr>"
        for r in report.ranks
    ]
    errors = "".join(f'<p class="bad">error: {escape(e)}</p>' for e in report.errors)
    if report.stock is not None and report.stock.failures:  # NOTE [stock failures are findings] in render/text.py
        errors += (
            '<p class="skip">Stock run (without the plugin) failed; a finding of the stock column, not an error of '
            "the audit:</p><ul>" + "".join(f"<li>stock: {escape(f)}</li>" for f in report.stock.failures) + "</ul>"
        )
    errors += "".join(f'<p class="skip">note: {escape(n)}</p>' for n in report.notes)
    risk_html = (
        '<h2 class="risk">Hang risk: collective sequences differ across ranks</h2><ul>'
        + "".join(f"<li>{escape(x)}</li>" for x in risks)
        + "</ul>"
        if risks
        else ""
    )
    num = report.numerics
    if num is not None:
        head = f"{num.compared} tensors compared per rank on ranks {format_ranks(num.ranks)}: "
        risk_html += (
            f'<h2 class="bad">Numerics: compiled step differs from eager</h2><p>{escape(head)}'
            f"{len(num.mismatches)} differ; first: <b>{escape(str(num.first))}</b></p><ul>"
            + "".join(f"<li>{escape(str(m))}</li>" for m in num.mismatches[:50])
            + "</ul>"
            if num.mismatches
            else f'<h2>Numerics</h2><p class="ok">{escape(head)}compiled step equals eager.</p>'
        )
    comm_html = ""
    if report.comm is not None:
        from .comm import comm_html as _comm_html

        comm_html = _comm_html(report.comm)
    stock_line = ""
    if report.stock is not None:
        stock_line = (
            f"<p>Without the plugin: {report.stock.total_breaks} graph break(s), "
            f"{report.stock.total_recompiles} recompile(s) per rank; with it: {report.total_breaks} and "
            f"{report.total_recompiles}.</p>"
        )
    return f"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8"><title>{escape(title)}</title>
<style>{_CSS}</style><script>{_JS}</script></head>
<body>
<h1>{escape(title)}</h1>
<p class="meta">{report.world_size} rank(s) &middot; backend {escape(report.backend or "as in the target")} &middot;
torch {escape(report.torch_version)} &middot; plugin {plugin}</p>
<p id="totals">Graph breaks per rank (worst rank): <b>{report.total_breaks}</b> &middot; recompiles: <b>{report.total_recompiles}</b>
&middot; distinct breaks: <b>{len(report.graph_breaks)}</b></p>
{stock_line}{errors}{risk_html}
<p>Per-rank view: <select id="rank-filter" onchange="showRank(this.value)"><option value="all">all ranks</option>{rank_opts}</select></p>
<h2>Graph breaks, by impact</h2>
<table id="breaks"><thead><tr><th>#</th><th>impact</th><th>where</th><th>gb_type / explanation / fix</th><th>ranks</th>{count_heads}<th>phase</th></tr></thead>
<tbody>{"".join(breaks)}</tbody></table>
<h2>Recompiles</h2>
<table id="recompiles"><thead><tr><th>function</th><th>where</th><th>failed guard</th><th>ranks</th><th>count</th></tr></thead>
<tbody>{"".join(recompiles)}</tbody></table>
<h2>Graphs</h2>
<table id="graphs"><thead><tr><th>graph</th><th>phase</th><th>ops</th><th>collectives (fwd)</th><th>collectives (bwd)</th><th>ranks</th><th>compile s</th>{"<th>fusions applied</th>" if fusions else ""}</tr></thead>
<tbody>{"".join(graphs)}</tbody></table>
{comm_html}<h2>Ranks</h2>
<table id="ranks"><thead><tr><th>rank</th><th>host</th><th>status</th><th>breaks</th><th>skips</th><th>graphs</th><th>recompiles</th><th>compile s</th><th>Dynamo counter</th><th>error</th></tr></thead>
<tbody>{"".join(ranks)}</tbody></table>
</body></html>
"""
