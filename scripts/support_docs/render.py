"""The generated parts of ``docs/support.md`` and ``dynamo_ext/_compat/releases/private_apis.py``.

Each generated region of a Markdown page sits between ``<!-- BEGIN GENERATED: <name> ... -->`` and
``<!-- END GENERATED: <name> -->``; :func:`splice` replaces what is between them and nothing else, so the
hand-written notes around them stay as they are.  Everything here is a pure function of the scan
(:mod:`.scan`), the presence records (:mod:`.presence`) and the recorded runs (:mod:`.runs`).
"""

from __future__ import annotations

import fnmatch
import re
from collections.abc import Iterable
from typing import Any

from .scan import CHECKS, COMPAT, Scan

RESULTS = "results"
PRIVATE_APIS = "private-apis"
_BEGIN = "<!-- BEGIN GENERATED: {name} (scripts/support_table.py write; do not edit by hand) -->"
_END = "<!-- END GENERATED: {name} -->"

# What each feature's tests are (a file counts in every row whose pattern it matches); the rows' numbers
# come from the recorded JUnit results only.  Files no row names are counted in "other tests".
FEATURES: tuple[tuple[str, tuple[str, ...]], ...] = (
    (
        "process groups, meshes, placements, guards, bad input",
        ("test_trackers.py", "test_guards.py", "test_guard_fuzz.py", "test_aliasing_guards.py", "test_bad_input.py"),
    ),
    ("c10d collectives, P2P, `torch.distributed.nn.functional`", ("test_collectives.py", "test_collectives_gloo.py")),
    ("DTensor and FSDP2 on gloo ranks", ("test_dtensor_fsdp_gloo.py",)),
    ("FSDP2 module groups `fully_shard([norm, output])`", ("test_fsdp_groups.py",)),
    (
        "FSDP2 training vs eager (eager backward, compiled autograd)",
        ("test_fsdp_training_gloo.py", "test_fsdp_reduce.py", "test_fsdp_gather_stamps.py"),
    ),
    ("`AsyncCollectiveTensor` inputs requiring grad", ("test_async_collective_inputs*.py",)),
    ("module backward hooks", ("test_backward_hooks*.py",)),
    (
        "compiled autograd: gradient accumulation, AOT backward calls",
        ("test_accumulate_grad.py", "test_aot_backward_calls.py"),
    ),
    ("blocks traced once, compiled once, reused", ("test_block_*.py",)),
    ("collective fusion lowerings and kernels (Inductor, CPU)", ("test_lowering_*.py", "test_kernel_*.py")),
    ("collective-sequence check", ("test_collective_check*.py", "test_collective_stream_gloo.py")),
    ("`spmd`, `data_parallel`, DDP overlap", ("test_spmd*.py", "test_ddp_overlap.py")),
    (
        "AOTAutograd cache keys, warm restarts",
        ("test_aot_cache_key.py", "test_precompile_cache.py", "test_warm_restart_*.py"),
    ),
    ("`dynamo-ext audit`", ("test_audit*.py",)),
)
_CHECK_TEXT = {
    "import attempt": "import attempt",
    "hasattr": "hasattr",
    "signature check": "signature",
    "behaviour check": "behaviour",
    "direct": "direct",
}
_MAX_WHERE = 3
_LINE = 116


def release_key(release: str) -> tuple[int, ...]:
    """``"2.12.1"`` -> ``(2, 12, 1)``; suffixes (``a0``, ``.dev...``, ``+cpu``) are dropped."""
    return tuple(int(m) for m in re.findall(r"\d+", release.split("+")[0])[:3])


def splice(text: str, name: str, body: str) -> str:
    """``text`` with the generated region ``name`` holding ``body``.

    Raises:
        ValueError: the page lacks the region's BEGIN/END comments (add them where the region belongs).
    """
    begin, end = _BEGIN.format(name=name), _END.format(name=name)
    pattern = re.compile(re.escape(begin) + r"\n.*?" + re.escape(end), re.S)
    if not pattern.search(text):
        raise ValueError(f"no generated region {name!r}: add the lines\n{begin}\n{end}\nwhere it belongs")
    return pattern.sub(lambda _: f"{begin}\n{body.rstrip()}\n{end}", text, count=1)


def region(text: str, name: str) -> str | None:
    """What the generated region ``name`` of ``text`` holds now, None without one."""
    begin, end = _BEGIN.format(name=name), _END.format(name=name)
    m = re.search(re.escape(begin) + r"\n(.*?)" + re.escape(end), text, re.S)
    return None if m is None else m.group(1)


# --- the results table ---


def _counts_cell(counts: dict[str, int]) -> str:
    ran = counts["passed"] + counts["failed"] + counts["error"]
    parts = [f"{counts['passed']}/{ran}"]
    if counts["failed"]:
        parts.append(f"{counts['failed']} failed")
    if counts["error"]:
        parts.append(f"{counts['error']} errors")
    if counts["skipped"]:
        parts.append(f"{counts['skipped']} skipped")
    return ", ".join(parts)


def _sum(files: dict[str, dict[str, int]], names: Iterable[str]) -> dict[str, int] | None:
    names = list(names)
    if not names:
        return None
    out = {"passed": 0, "failed": 0, "error": 0, "skipped": 0}
    for n in names:
        for k in out:
            out[k] += files[n][k]
    return out


def _matches(file: str, patterns: Iterable[str]) -> bool:
    base = file.rpartition("/")[2]
    return any(fnmatch.fnmatch(base, p) for p in patterns)


def _corpus_cell(run: dict[str, Any], ours: bool) -> str:
    cells = []
    for backend in ("aot_eager", "eager"):
        data = run["corpus"].get(backend)
        if data is None:
            cells.append("not run")
        elif "missing" in data:
            cells.append(f"no result (exit {data['exit']})")
        else:
            cases = [c for c in data["cases"] if c["ours"] == ours]
            cells.append(f"{sum(c['ok'] for c in cases)}/{len(cases)}")
    return ", ".join(cells)


def _pytest_cell(run: dict[str, Any]) -> str:
    pytest = run["pytest"]
    scope = "whole default suite" if pytest["full"] else "partial run: `" + " ".join(pytest["args"]) + "`"
    if "missing" in pytest:
        return f"{scope}; {pytest['missing']} (exit {pytest['exit']})"
    t = pytest["totals"]
    return f"{scope}: {t['passed']} passed, {t['failed']} failed, {t['error']} errors, {t['skipped']} skipped"


def results_table(runs: dict[str, dict[str, Any]], releases: Iterable[str]) -> str:
    """The results table: one column per release, each cell from that release's recorded run."""
    columns = sorted(set(releases) | set(runs), key=release_key)
    rows: list[tuple[str, list[str]]] = []

    def row(label: str, cell: Any) -> None:
        rows.append((label, [cell(runs[r]) if r in runs else "–" for r in columns]))

    def recorded(run: dict[str, Any]) -> str:
        dirty = " + uncommitted changes" if run.get("uncommitted_changes") else ""
        return f"{run['date']}, `{run['commit']}`{dirty}, torch {run['torch_version']}"

    rows.append(("run recorded", [recorded(runs[r]) if r in runs else "**no recorded run**" for r in columns]))
    row("tests (pytest)", _pytest_cell)
    row("public corpus, `aot_eager` / `eager`", lambda run: _corpus_cell(run, ours=False))
    row("our corpus cases (`tests/corpus_cases.py`), `aot_eager` / `eager`", lambda run: _corpus_cell(run, ours=True))
    named: set[str] = set()
    for label, patterns in FEATURES:

        def cell(run: dict[str, Any], patterns: tuple[str, ...] = patterns) -> str:
            files = run["pytest"].get("files", {})
            chosen = [f for f in files if _matches(f, patterns)]
            named.update(chosen)
            counts = _sum(files, chosen)
            return "not run" if counts is None else _counts_cell(counts)

        row(label, cell)

    def other(run: dict[str, Any]) -> str:
        files = run["pytest"].get("files", {})
        counts = _sum(files, [f for f in files if not any(_matches(f, p) for _, p in FEATURES)])
        return "not run" if counts is None else _counts_cell(counts)

    row("other tests", other)
    lines = ["| | " + " | ".join(columns) + " |", "|---" * (len(columns) + 1) + "|"]
    lines += [f"| {label} | " + " | ".join(cells) + " |" for label, cells in rows]
    return "\n".join(lines)


def failures(runs: dict[str, dict[str, Any]]) -> str:
    """Per release with a run: the tests and corpus cases that did not pass, with their message's first line."""
    out = []
    for release in sorted(runs, key=release_key):
        run = runs[release]
        items = [
            f"  - `{t['id']}` ({t['outcome']}): {t['message']}".rstrip(": ")
            for t in run["pytest"].get("not_passed", [])
            if t["outcome"] != "skipped"
        ]
        for backend, data in sorted(run["corpus"].items()):
            items += [
                f"  - corpus `{c['case']}` ({backend}): {c['note']}".rstrip(": ")
                for c in data.get("cases", [])
                if not c["ok"]
            ]
        if items:
            out.append(f"- {release}:\n" + "\n".join(items))
    return "\n".join(out) if out else "None recorded."


def results_region(runs: dict[str, dict[str, Any]], releases: Iterable[str]) -> str:
    """The body of the ``results`` region."""
    partial = [r for r in sorted(runs, key=release_key) if not runs[r]["pytest"]["full"]]
    text = [
        "Recorded by `scripts/other_torch.sh RELEASE` (the suite, then the shared corpus with the plugin on 4 gloo",
        "ranks, `aot_eager` and `eager` backends, in that release's virtual environment; CUDA builds from the",
        "registry run on the CPU) into `docs/support/runs/RELEASE.json`, and rendered from those files only. A",
        "cell gives passed/run, then failures, errors and skips; a partial run names its pytest arguments.",
        "",
        results_table(runs, releases),
        "",
    ]
    if partial:
        text += [f"Partial runs (not the whole suite): {', '.join(partial)}.", ""]
    text += ["Tests and corpus cases that did not pass, as recorded:", "", failures(runs)]
    return "\n".join(text)


# --- the private API table ---


def _display(path: str, scan: Scan, presence: dict[str, dict[str, Any]]) -> tuple[str, str]:
    """(module, name) of a path: the module as the newest release that has the path resolved it."""
    module = scan.modules.get(path, "torch")
    for release in sorted(presence, key=release_key, reverse=True):
        entry = presence[release]["apis"].get(path)
        if entry is not None and entry["present"]:
            module = entry["module"]
            break
    name = path[len(module) + 1 :] if path != module else "(module)"
    return module, name


def _short(function: str) -> str:
    return function.removeprefix("dynamo_ext.")


def where(sites: Iterable[Any]) -> tuple[str, bool]:
    """The probe functions (in ``_compat``) or files (outside it) a path is used from, and whether any use
    is outside ``_compat`` without going through one of its functions."""
    entries: list[str] = []
    outside = False
    for s in sorted(sites):
        if s.file.startswith("dynamo_ext/_compat/"):
            entry = f"`{_short(s.function)}`"
        elif s.via.startswith(COMPAT):
            entry = f"`{_short(s.via)}` from `{s.file}`"
        else:
            entry = f"`{s.file}`"
            outside = True
        if entry not in entries:
            entries.append(entry)
    shown = entries[:_MAX_WHERE]
    if len(entries) > _MAX_WHERE:
        shown.append(f"{len(entries) - _MAX_WHERE} more")
    return ", ".join(shown), outside


def checks(sites: Iterable[Any]) -> str:
    found = {s.check for s in sites}
    return ", ".join(_CHECK_TEXT[c] for c in CHECKS if c in found)


def api_rows(scan: Scan, presence: dict[str, dict[str, Any]]) -> list[tuple[str, str, str, str, bool, list[str]]]:
    """(module, name, checks, where, outside _compat, per-release presence) for every path, sorted."""
    releases = sorted(presence, key=release_key)
    rows = []
    for path in scan.paths():
        module, name = _display(path, scan, presence)
        places, outside = where(scan.apis[path])
        cells = []
        for r in releases:
            entry = presence[r]["apis"].get(path)
            cells.append("not probed" if entry is None else "yes" if entry["present"] else "**no**")
        rows.append((module, name, checks(scan.apis[path]), places, outside, cells))
    return sorted(rows, key=lambda r: (r[0], r[1]))


def private_api_region(scan: Scan, presence: dict[str, dict[str, Any]]) -> str:
    """The body of the ``private-apis`` region."""
    releases = sorted(presence, key=release_key)
    rows = api_rows(scan, presence)
    modules = {r[0] for r in rows}
    outside = sum(r[4] for r in rows)
    recorded = (
        "; ".join(f"{r}: torch {presence[r]['torch_version']}, {presence[r]['date']}" for r in releases) or "none"
    )
    text = [
        f"{len(rows)} private torch paths in {len(modules)} modules, found by `scripts/support_table.py`'s scan of",
        "`dynamo_ext/` (imports, `importlib.import_module`, `_compat.optional_attr`, attribute chains and",
        "`getattr`/`hasattr` through private names: `scripts/support_docs/scan.py`). *check*: how the code around",
        "each use probes it (NOTE [how _compat probes an API] there): `import attempt`, `hasattr`, `signature`",
        "(`inspect.signature`, a code object's names), `behaviour` (called under `except TypeError`, or a probe",
        "that says it calls it), `direct` (used as if every release had it). *where*: the `_compat` function, or",
        f"the file outside `_compat` ({outside} paths are used outside it without a `_compat` function).",
        f"Presence per release: `docs/support/api_presence/RELEASE.json` ({recorded}).",
        "",
        "| module | name | check | where | " + " | ".join(releases) + " |",
        "|---|---|---|---|" + "---|" * len(releases),
    ]
    for module, name, how, places, _, cells in rows:
        text.append(f"| `{module}` | `{name}` | {how} | {places} | " + " | ".join(cells) + " |")
    text += [
        "",
        "Private attributes `_compat` reads on objects whose class the code does not name (not probed per release):",
        "",
    ]
    text += ["| attribute | check | where |", "|---|---|---|"]
    for name in sorted(scan.object_attrs):
        places, _ = where(scan.object_attrs[name])
        text.append(f"| `{name}` | {checks(scan.object_attrs[name])} | {places} |")
    text += ["", "Lookups the scan cannot name (the name is not a literal it can follow):", ""]
    if scan.unresolved:
        text += [f"- `{u.pattern}` in `{_short(u.function)}` (`{u.file}:{u.line}`)" for u in sorted(scan.unresolved)]
    else:
        text.append("- none")
    return "\n".join(text)


# --- the list install() checks on an unverified release ---


def private_apis_module(scan: Scan, presence: dict[str, Any]) -> str:
    """``dynamo_ext/_compat/releases/private_apis.py``: the paths present on the last verified release (whose
    presence record is ``presence``), by the module the code imports, ``!`` before a name used directly."""
    by_module: dict[str, list[str]] = {}
    for path in scan.paths():
        entry = presence["apis"].get(path)
        if entry is None or not entry["present"]:
            continue
        module = scan.modules.get(path, "torch")
        name = path[len(module) + 1 :]
        names = by_module.setdefault(module, [])
        if name:
            direct = any(s.check == "direct" for s in scan.apis[path])
            names.append(("!" if direct else "") + name)
    lines = []
    for module in sorted(by_module):
        line = f"{module}:"
        for name in sorted(by_module[module], key=lambda n: n.lstrip("!")):
            if len(line) + 1 + len(name) > _LINE:
                lines.append(line)
                line = "   "
            line += " " + name
        lines.append(line)
    body = "\n".join(lines)
    return (
        '"""The private torch APIs dynamo-ext uses that the last verified release has (generated: do not edit).\n'
        "\n"
        "Written by ``scripts/support_table.py write`` from its scan of ``dynamo_ext/`` and\n"
        f"``docs/support/api_presence/{presence['release']}.json``; ``tests/test_support_table.py`` checks it is current.\n"
        "One entry per module the code imports: ``module: name ...`` (indented lines continue it), a name being an\n"
        "attribute chain from the module, ``!`` before one the code uses directly (a release without it fails\n"
        "where it is used).\n"
        '"""\n'
        "\n"
        f'RELEASE = "{presence["release"]}"\n'
        f'PRIVATE_APIS = """\n{body}\n"""\n'
    )
