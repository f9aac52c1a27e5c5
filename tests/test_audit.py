"""Unit tests of the audit: merge, identity, ranking, JSON schema, diff and gate on hand-made events,
plus the in-process API (one process, no process group)."""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import os
import sysconfig
import tempfile
from pathlib import Path

import pytest
import torch
from expecttest import TestCase
from torch._dynamo.utils import counters

from dynamo_ext.audit import audit, diff_reports, gate, report_from_json
from dynamo_ext.audit.merge.merger import merge
from dynamo_ext.audit.rank import numerics
from dynamo_ext.audit.rank.collector import collective_sequence, collectives_in, parse_message
from dynamo_ext.audit.rank.identity import (
    break_id,
    fix_for,
    is_distributed_cause,
    normalize_path,
    target_root,
    user_frame_index,
)


# ---- hand-made events ---------------------------------------------------------------
def brk(
    gb_type="Failed to trace builtin operator",
    file="train.py",
    line=10,
    function="step",
    *,
    phase="forward",
    kind="graph_break",
    distributed=False,
    source="print(x)",
):
    return {
        "ev": "break",
        "kind": kind,
        "gb_type": gb_type,
        "wrapper": "",
        "reason": gb_type,
        "explanation": "Dynamo does not know how to trace builtin operator `print`.",
        "hints": ["Avoid calling builtin `print`."],
        "context": "",
        "stack": [["main.py", 3, "<module>", "step(x)"], [file, line, function, source]],
        "user_index": 1,
        "abs_file": "",
        "distributed": distributed,
        "phase": phase,
        "compile_id": "0/0",
    }


def comp(function="step", file="train.py", line=8, *, ops=5, recompile=None, colls=None, code_name=None, seq=None):
    colls = colls or ({n: seq.count(n) for n in seq} if seq else {})
    return {
        "ev": "compile",
        "compile_id": "0/0",
        "function": function,
        "code_name": code_name or function,
        "file": file,
        "line": line,
        "op_count": ops,
        "has_graph": True,
        "collectives": colls,
        "backward_collectives": {},
        "collective_sequence": seq if seq is not None else [n for n, k in sorted(colls.items()) for _ in range(k)],
        "backward_collective_sequence": [],
        "time_s": 0.5,
        "recompile_reason": recompile,
        "fail_type": None,
        "fail_reason": None,
        "phase": "forward",
    }


def run_events(*body):
    start = {"ev": "start", "plugin": {"installed": True, "version": "0.1.0", "error": ""}}
    return [
        start,
        *body,
        {
            "ev": "end",
            "counters": {
                "graph_break": sum(1 for e in body if e["ev"] == "break" and e["kind"] == "graph_break"),
                "unique_graphs": 1,
            },
        },
    ]


def report_of(events_by_rank, world_size=None):
    return merge(events_by_rank, target="train.py", world_size=world_size or len(events_by_rank), backend="eager")


class TestMerge(TestCase):
    def test_same_break_on_all_ranks_is_one_row(self):
        r = report_of({0: run_events(brk(), comp()), 1: run_events(brk(), comp())})
        self.assertEqual(len(r.graph_breaks), 1)
        b = r.graph_breaks[0]
        self.assertEqual(b.ranks, (0, 1))
        self.assertEqual(b.count, 2)
        self.assertEqual(b.id, "Failed to trace builtin operator | train.py:10 | step")
        self.assertFalse(b.hang_risk)
        self.assertEqual(r.hang_risks, ())
        self.assertEqual([x.dynamo_graph_breaks for x in r.ranks], [1, 1])

    def test_break_on_some_ranks_is_divergent_not_a_hang_risk(self):
        r = report_of({0: run_events(brk(), comp()), 1: run_events(comp())})
        self.assertTrue(r.graph_breaks[0].divergent)
        self.assertFalse(r.graph_breaks[0].hang_risk)
        self.assertEqual(r.graph_breaks[0].ranks, (0,))
        self.assertEqual(r.hang_risks, ())
        self.assertEqual(gate(r), [])

    def test_rank_dependent_graphs_with_same_collectives_are_not_hang_risks(self):
        # e.g. the plugin's rooted broadcast: the root's graph has other ops than the receivers'.
        r = report_of(
            {
                0: run_events(comp(ops=5, seq=["broadcast", "all_reduce"])),
                1: run_events(comp(ops=6, seq=["broadcast", "all_reduce"])),
            }
        )
        (g,) = r.graphs
        self.assertTrue(g.divergent)
        self.assertFalse(g.hang_risk)
        self.assertEqual(g.op_count_by_rank, ((0, 5), (1, 6)))
        self.assertEqual(r.hang_risks, ())

    def test_different_collective_sequence_is_a_hang_risk_and_fails_the_gate(self):
        for seq0, seq1 in (
            (["all_reduce", "all_reduce"], ["all_reduce"]),
            (["all_reduce", "broadcast"], ["broadcast", "all_reduce"]),
        ):
            r = report_of({0: run_events(brk(), comp(seq=seq0)), 1: run_events(comp(seq=seq1))})
            (g,) = r.graphs
            self.assertTrue(g.hang_risk, (seq0, seq1))
            self.assertTrue(r.graph_breaks[0].hang_risk)  # the divergent break in that code is where it comes from
            (line,) = r.hang_risks
            self.assertIn(f"rank 0: [{', '.join(seq0)}]", line)
            self.assertIn(f"rank 1: [{', '.join(seq1)}]", line)
            self.assertEqual(gate(r)[0], "1 hang risk(s), budget --max-hang-risks 0")
            self.assertEqual(gate(r, max_hang_risks=1), [])
            self.assertEqual(gate(r, max_hang_risks=None), [])

    def test_graph_with_collectives_missing_on_a_rank_is_a_hang_risk(self):
        r = report_of({0: run_events(comp(), comp("other", line=20, seq=["all_reduce"])), 1: run_events(comp())})
        risky = [g.id for g in r.graphs if g.hang_risk]
        self.assertEqual(risky, ["train.py:20 other"])

    def test_graph_identity_is_code_and_reason_not_compile_order(self):
        # Rank 0 recompiles `step` once more than rank 1; `other`'s identity must not shift.
        rc = "0/1: tensor 'x' size mismatch at index 0. expected 4, actual 5"
        r = report_of(
            {
                0: run_events(comp(), comp(recompile=rc), comp("other", line=20)),
                1: run_events(comp(), comp("other", line=20)),
            }
        )
        ids = {g.id: g for g in r.graphs}
        self.assertEqual(
            sorted(ids),
            [
                "train.py:20 other",
                "train.py:8 step",
                "train.py:8 step | recompile: tensor 'x' size mismatch at index 0. expected 4, actual 5",
            ],
        )
        self.assertFalse(ids["train.py:20 other"].divergent)
        self.assertEqual(ids["train.py:20 other"].ranks, (0, 1))
        self.assertTrue(ids[sorted(ids)[2]].divergent)
        self.assertEqual(r.hang_risks, ())  # no collectives in the extra graph

    def test_single_rank_never_diverges(self):
        r = report_of({0: run_events(brk())})
        self.assertFalse(r.graph_breaks[0].hang_risk)

    def test_rank_that_died_is_not_the_reference(self):
        events = {0: run_events(brk()), 1: [{"ev": "start", "plugin": {}}, brk()]}
        r = report_of(events)
        self.assertEqual([x.status for x in r.ranks], ["ok", "died"])
        self.assertFalse(r.graph_breaks[0].hang_risk)
        self.assertFalse(r.ok)

    def test_ranked_by_impact(self):
        once = brk(
            line=20, source="y.item()", gb_type="Unsupported Tensor.item() call with capture_scalar_outputs=False"
        )
        r = report_of({0: run_events(once, brk(), brk()), 1: run_events(once, brk(), brk())})
        self.assertEqual([b.line for b in r.graph_breaks], [10, 20])
        self.assertGreater(r.graph_breaks[0].impact, r.graph_breaks[1].impact)

    def test_recompile_of_resume_function_counts_for_the_break(self):
        resume = comp(
            function="step",
            code_name="torch_dynamo_resume_in_step_at_10",
            line=10,
            recompile="0/0: tensor 'x' size mismatch at index 0. expected 4, actual 5",
        )
        r = report_of({0: run_events(brk(), comp(), resume)})
        self.assertEqual(r.graph_breaks[0].recompiles_caused, 1)
        self.assertEqual(r.recompiles[0].reason, "tensor 'x' size mismatch at index 0. expected 4, actual 5")
        self.assertEqual(r.total_recompiles, 1)

    def test_id_guard_recompile_is_one_row_across_ranks(self):
        # An ID_MATCH guard names a per-process id() (seen on the HF Mixtral target: a code object per rank).
        def rc(n):
            return comp(
                "forward_with_checkpointing", line=88, recompile=f"1/0: ___check_obj_id(forward.__code__, {n})  # x"
            )

        r = report_of({0: run_events(comp("forward_with_checkpointing", line=88), rc(94211665358448)),
                       1: run_events(comp("forward_with_checkpointing", line=88), rc(94803169406448))})  # fmt: skip
        (rec,) = r.recompiles
        self.assertEqual(rec.ranks, (0, 1))
        self.assertEqual(rec.reason, "___check_obj_id(forward.__code__, <id>)  # x")
        graphs = sorted(g.id for g in r.graphs)
        self.assertEqual(
            graphs,
            [
                "train.py:88 forward_with_checkpointing",
                "train.py:88 forward_with_checkpointing | recompile: ___check_obj_id(forward.__code__, <id>)",
            ],
        )
        self.assertTrue(all(g.ranks == (0, 1) for g in r.graphs))

    def test_frame_skip_counted_apart_from_graph_breaks(self):
        r = report_of({0: run_events(brk(kind="frame_skip"), brk(line=30))})
        self.assertEqual((r.ranks[0].graph_breaks, r.ranks[0].frame_skips), (1, 1))
        self.assertEqual(r.total_breaks, 2)


class TestIdentity(TestCase):
    def test_break_id(self):
        self.assertEqual(break_id("gb", "a/b.py", 3, "f"), "gb | a/b.py:3 | f")

    def test_normalize_path_is_never_absolute(self):
        self.assertEqual(normalize_path("/repo/pkg/m.py", root="/repo"), "pkg/m.py")
        self.assertEqual(
            normalize_path("/venv/lib/python3.11/site-packages/transformers/x.py", root="/repo"), "transformers/x.py"
        )
        # A virtualenv under the root is still an installed package.
        self.assertEqual(
            normalize_path("/repo/.venv/lib/python3.11/site-packages/torch/a.py", root="/repo"), "torch/a.py"
        )
        self.assertEqual(normalize_path("<eval_with_key>.15", root="/repo"), "<fx-generated>")
        self.assertEqual(normalize_path("/elsewhere/deep/m.py", root="/repo"), "<external>/deep/m.py")
        self.assertEqual(
            normalize_path(os.path.join(sysconfig.get_paths()["stdlib"], "contextlib.py")), "<stdlib>/contextlib.py"
        )

    def test_target_root_and_machine_independent_identity(self):
        # The same checkout at two places on two machines gives the same identities.
        with tempfile.TemporaryDirectory() as a, tempfile.TemporaryDirectory() as b:
            for base in (a, b):
                os.makedirs(os.path.join(base, "proj", "scripts"))
                open(os.path.join(base, "proj", "pyproject.toml"), "w").close()
            paths = [os.path.join(base, "proj", "scripts", "train.py") for base in (a, b)]
            roots = [target_root(p) for p in paths]
            self.assertEqual(roots, [os.path.join(base, "proj") for base in (a, b)])
            self.assertEqual({normalize_path(p, root=r) for p, r in zip(paths, roots)}, {"scripts/train.py"})
            # No marker: the script's own directory.
            lone = os.path.join(a, "lone.py")
            self.assertEqual(normalize_path(lone, root=target_root(lone)), "lone.py")

    def test_user_frame_is_deepest_outside_torch(self):
        torch_file = torch.__file__.replace("__init__.py", "distributed/distributed_c10d.py")
        self.assertEqual(user_frame_index(["main.py", "model.py", torch_file]), 1)
        self.assertEqual(user_frame_index([torch_file]), 0)

    def test_distributed_cause(self):
        self.assertTrue(is_distributed_cause("dynamo_ext: object collective", ["a.py"]))
        self.assertTrue(
            is_distributed_cause("Attempted to call function marked as skipped", ["torch/distributed/fsdp/x.py"])
        )
        self.assertFalse(is_distributed_cause("Failed to trace builtin operator", ["a.py"], "print"))

    def test_fixes(self):
        self.assertIn(
            "all_gather_into_tensor", fix_for("Attempted to call", "dist.all_gather_object(out, x)", (), True)
        )
        self.assertIn("barrier", fix_for("x", "dist.barrier()", (), True))
        self.assertIn("compiled autograd", fix_for("x", "torch/distributed/fsdp/_fully_shard/_fsdp_state.py", (), True))
        self.assertIn("functional collective", fix_for("x", "work = dist.all_reduce(t, async_op=True)", (), True))
        self.assertEqual(fix_for("Failed to trace builtin operator", "print", ("Avoid print.",), False), "Avoid print.")
        self.assertIn("Move this call out", fix_for("dynamo_ext: object collective", "", (), True))


class TestParsing(TestCase):
    def test_parse_dynamo_message(self):
        msg = (
            "Failed to trace builtin operator\n"
            "  Explanation: Dynamo does not know how to trace builtin operator `print`\n"
            "    with argument types ['str'].\n"
            "  Hint: Avoid calling builtin `print`.\n"
            "  Hint: Please report an issue to PyTorch.\n\n"
            "  Developer debug context: builtin print\n\n"
            " For more details about this graph break, please visit: https://example.invalid/gb0059.html"
        )
        first, expl, hints, ctx = parse_message(msg)
        self.assertEqual(first, "Failed to trace builtin operator")
        self.assertEqual(
            expl, "Dynamo does not know how to trace builtin operator `print` with argument types ['str']."
        )
        self.assertEqual(hints, ("Avoid calling builtin `print`.", "Please report an issue to PyTorch."))
        self.assertEqual(ctx, "builtin print")

    def test_collectives_in_graph_text(self):
        text = """
        # File: funcol.py:179 in all_reduce, code: tensor = torch.ops._c10d_functional.all_reduce(
        all_reduce = torch.ops._c10d_functional.all_reduce.default(x, 'sum', '0')
        wait_tensor = torch.ops._c10d_functional.wait_tensor.default(all_reduce)
        ag = torch.ops._c10d_functional.all_gather_into_tensor.default(y, 2, '0')
        ar2 = torch.ops._c10d_functional.all_reduce.default(z, 'sum', '1')
        """
        self.assertEqual(collectives_in(text), {"all_reduce": 2, "all_gather_into_tensor": 1})
        self.assertEqual(collective_sequence(text), ["all_reduce", "all_gather_into_tensor", "all_reduce"])


def _sample():
    return report_of(
        {0: run_events(brk(), comp(colls={"all_reduce": 1})), 1: run_events(brk(), comp(colls={"all_reduce": 1}))}
    )


class TestJsonAndGate(TestCase):
    def test_schema_keys(self):
        data = json.loads(json.dumps(_sample().to_json()))
        for key in (
            "schema_version",
            "graph_breaks",
            "graphs",
            "recompiles",
            "ranks",
            "torch_version",
            "plugin",
            "totals",
            "stock",
        ):
            self.assertIn(key, data)
        b = data["graph_breaks"][0]
        for key in (
            "id",
            "kind",
            "gb_type",
            "file",
            "line",
            "function",
            "source",
            "explanation",
            "hints",
            "fix",
            "distributed",
            "phase",
            "ranks",
            "count",
            "count_by_rank",
            "stack",
            "hang_risk",
            "impact",
        ):
            self.assertIn(key, b)
        self.assertEqual(data["totals"]["graph_breaks"], 1)
        self.assertEqual(data["graphs"][0]["collectives"], [["all_reduce", 1]])

    def test_round_trip(self):
        r = dataclasses.replace(_sample(), stock=_sample())
        back = report_from_json(json.loads(json.dumps(r.to_json())))
        self.assertEqual(back, r)

    def test_not_a_report(self):
        with self.assertRaisesRegex(ValueError, "not a dynamo-ext audit report"):
            report_from_json({"foo": 1})

    def test_diff(self):
        old = _sample()
        new = report_of({0: run_events(brk(line=11), comp()), 1: run_events(brk(line=11), comp())})
        d = diff_reports(old, new)
        self.assertEqual([b.line for b in d.new], [11])
        self.assertEqual([b.line for b in d.fixed], [10])
        self.assertEqual(d.unchanged, ())
        self.assertIn("new: 1", str(d))

    def test_gate(self):
        r = _sample()
        self.assertEqual(gate(r, max_breaks=1, max_recompiles=0), [])
        self.assertEqual(gate(r, max_breaks=0), ["1 graph break(s) per rank, budget --max-breaks 0"])
        self.assertEqual(gate(r, baseline=r), [])
        empty = report_of({0: run_events(comp()), 1: run_events(comp())})
        self.assertEqual(
            gate(r, baseline=empty),
            ["new graph break not in the baseline: Failed to trace builtin operator | train.py:10 | step"],
        )

    def test_str_is_the_report(self):
        text = str(_sample())
        self.assertIn("dynamo-ext audit: train.py", text)
        self.assertIn("train.py:10", text)
        self.assertIn("Failed to trace builtin operator", text)
        self.assertExpectedInline(
            text.split("Ranks")[1],
            """\


  rank   host   status   breaks   skips   graphs   recompiles   compile s   counters
 ━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━
  0, 1   ?      ok       1        0       1        0            0.50        ok

""",
        )


# ---- the in-process API: one process, Dynamo's own counters ------------------------------
def _two_breaks(x):
    x = x * 2
    print("audit api")
    if x.sum().item() > 0:
        x = x + 1
    return x.relu()


def _looped(x):
    for _ in range(2):
        x = x + 1
        print("loop")
    return x


def _counter_snapshot():
    return {k: dict(v) for k, v in counters.items() if v}


def _inner_break(x, k):
    x = x + k
    print("inner")
    return x * k


def _recompiling(x):  # _inner_break is compiled as its own frame, then again for k=2: a recompile
    return _inner_break(_inner_break(x, 1), 2)


class TestApi(TestCase):
    def test_every_record_names_the_callers_rank(self):
        """On rank 2 of a world of 4, breaks, graphs, recompiles and the rank summary all say rank 2."""
        from helpers import fake_world

        with fake_world(4, rank=2):
            report = audit(_recompiling, torch.ones(3), backend="eager")
        self.assertEqual([r.rank for r in report.ranks], [2])
        self.assertTrue(report.graphs and report.recompiles and report.graph_breaks)
        for record in (*report.graphs, *report.recompiles, *report.graph_breaks):
            self.assertEqual(record.ranks, (2,), record)
        self.assertEqual({r for g in report.graphs for r, _ in g.op_count_by_rank}, {2})
        self.assertEqual({r for x in report.recompiles for r, _ in x.count_by_rank}, {2})

    def test_counts_equal_dynamo_counters(self):
        report = audit(_two_breaks, torch.ones(4), backend="eager")
        self.assertEqual(report.ranks[0].graph_breaks, report.ranks[0].dynamo_graph_breaks)
        self.assertEqual(report.ranks[0].graph_breaks, 2)
        lines = sorted(b.line for b in report.graph_breaks)
        first = _two_breaks.__code__.co_firstlineno
        self.assertEqual(lines, [first + 2, first + 3])
        self.assertTrue(
            all(b.file == "tests/test_audit.py" and b.function == "_two_breaks" for b in report.graph_breaks)
        )
        self.assertEqual(report.ranks[0].graphs, 3)
        self.assertEqual(
            sorted(b.source for b in report.graph_breaks), ["if x.sum().item() > 0:", 'print("audit api")']
        )

    def test_break_in_skipped_frame_still_counts(self):
        report = audit(_looped, torch.ones(4), backend="eager")
        self.assertEqual(report.ranks[0].dynamo_graph_breaks, 0)  # Dynamo's counter misses it
        (b,) = report.graph_breaks
        self.assertEqual((b.kind, b.wrapper), ("frame_skip", "graph break in loop"))
        self.assertEqual(b.line, _looped.__code__.co_firstlineno + 3)
        self.assertEqual(report.total_breaks, 1)

    def test_target_exception_propagates(self):
        def boom(x):
            raise ValueError("boom")

        with pytest.raises(ValueError, match="boom"):
            audit(boom, torch.ones(2), backend="eager")

    def test_restores_dynamo_state_and_counters(self):
        # Another compiled function of the caller keeps its cache entry (no torch._dynamo.reset()),
        # a function compiled earlier is compiled afresh for the report, and the counters are as before.
        def other(x):
            return x.sin()

        def step(x):
            print("restores")
            return x + 1

        compiled_other = torch.compile(other, backend="eager")
        compiled_other(torch.ones(3))
        torch.compile(step, backend="eager")(torch.ones(3))
        before = _counter_snapshot()
        report = audit(step, torch.ones(3), backend="eager")
        self.assertEqual([b.source for b in report.graph_breaks], ['print("restores")'])
        self.assertEqual(report.ranks[0].dynamo_graph_breaks, 1)
        self.assertEqual(_counter_snapshot(), before)
        with torch._dynamo.config.patch(error_on_recompile=True):
            compiled_other(torch.ones(3))  # would raise if its entry had been dropped or shadowed


# ---- one target per kind of graph break (tests/audit_targets/break_kinds.py) -----------------
_KINDS = Path(__file__).resolve().parent / "audit_targets" / "break_kinds.py"


def _load(path, name):
    """A target file under tests/audit_targets imported as module ``name``."""
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _break_kinds():
    return _load(_KINDS, "audit_break_kinds")


def _marker_line(marker):
    return next(n for n, line in enumerate(_KINDS.read_text().splitlines(), 1) if marker in line)


@pytest.mark.parametrize(
    ("name", "marker", "gb_type", "kind", "wrapper", "function"),
    [
        ("data_dependent_branch", "BREAK_DATA_DEPENDENT", "Data-dependent branching", "graph_break", "", None),
        ("unsupported_call", "BREAK_UNSUPPORTED_CALL", "Failed to trace builtin operator", "graph_break", "", None),
        (
            "skipped_frame",
            "BREAK_SKIPPED_FRAME",
            "Failed to trace builtin operator",
            "frame_skip",
            "graph break in loop",
            None,
        ),
        ("disabled", "BREAK_DISABLED", "Skip calling `torch.compiler.disable()`d function", "graph_break", "", None),
        (
            "generic_context_manager",
            "BREAK_GENERIC_CONTEXT",
            "Failed to trace builtin operator",
            "frame_skip",
            "Graph break under GenericContextWrappingVariable",
            None,
        ),
        ("recompile_limit", "BREAK_RECOMPILE_LIMIT", "Dynamo recompile limit exceeded", "frame_skip", "", "_scaled"),
    ],
)
def test_each_kind_of_break_at_its_line_with_its_gb_type(name, marker, gb_type, kind, wrapper, function):
    fn = getattr(_break_kinds(), name)
    with torch._dynamo.config.patch(recompile_limit=2, automatic_dynamic_shapes=False):
        report = audit(fn, torch.ones(3), backend="eager")
    line = _marker_line(marker)
    by_line = {(b.file, b.line): b for b in report.graph_breaks}
    b = by_line[("tests/audit_targets/break_kinds.py", line)]
    assert (b.gb_type, b.kind, b.wrapper, b.function) == (gb_type, kind, wrapper, function or name), b
    assert marker in b.source
    assert b.id == f"{gb_type} | tests/audit_targets/break_kinds.py:{line} | {function or name}"
    r = report.ranks[0]
    # The audit's count agrees with Dynamo's counter, plus the breaks Dynamo misses (2.13: data-dependent).
    assert r.graph_breaks == r.dynamo_graph_breaks + r.dynamo_missed, r


# ---- the numerics check (dynamo_ext/audit/numerics.py), in-process ----------------------------
_WRONG = Path(__file__).resolve().parent / "audit_targets" / "numerics_wrong.py"


def _numerics_wrong():
    return _load(_WRONG, "audit_numerics_wrong")


def _linear_step(scale_loss_under_compile):
    def make_step():
        torch.manual_seed(0)
        model = torch.nn.Linear(4, 2)
        optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
        x = torch.randn(3, 4)

        def loss_fn(x):
            loss = model(x).square().mean()
            if scale_loss_under_compile and torch.compiler.is_compiling():
                loss = loss * 1.01
            return loss

        compiled = torch.compile(loss_fn, backend="eager")

        def step(use_compile):
            loss = (compiled if use_compile else loss_fn)(x)
            loss.backward()
            return loss

        return model, optim, step

    return make_step


class TestNumerics(TestCase):
    def test_equal_step_has_no_mismatch_and_counts_every_tensor(self):
        report = audit(_two_breaks, torch.ones(4), backend="eager", check_numerics=_linear_step(False))
        n = report.numerics
        self.assertEqual(n.mismatches, ())
        self.assertEqual(n.compared, 1 + 2 + 2)  # loss; weight and bias gradients; weight and bias after AdamW
        self.assertEqual(gate(report), [])
        self.assertIn("0 mismatches", str(report))

    def test_value_changed_only_under_compile_fails_the_gate_naming_the_loss(self):
        report = audit(_two_breaks, torch.ones(4), backend="eager", check_numerics=_linear_step(True))
        first = report.numerics.first
        self.assertEqual((first.kind, first.name, first.rank), ("output", "loss", 0))
        self.assertAlmostEqual(first.max_rel, 0.01, places=5)
        # The 1% larger loss also scales every gradient; AdamW's update is scale-invariant in its first step.
        self.assertEqual([m.name for m in report.numerics.mismatches if m.kind == "grad"], ["weight", "bias"])
        problems = gate(report)
        self.assertTrue(problems[0].startswith("numerics: 3 tensor(s) differ between the compiled and the eager step"))
        self.assertIn("first: output loss on rank 0: max abs error", problems[0])
        self.assertIn("MISMATCH", str(report))

    def test_gradient_wrong_only_under_compile_names_the_parameter(self):
        report = audit(_two_breaks, torch.ones(4), backend="eager", check_numerics=_numerics_wrong().make_step)
        ms = report.numerics.mismatches
        self.assertEqual((ms[0].kind, ms[0].name), ("grad", "lin.weight"))
        self.assertAlmostEqual(ms[0].max_rel, 0.01, delta=2e-3)
        self.assertNotIn("output", {m.kind for m in ms})
        self.assertIn(("param", "lin.weight"), {(m.kind, m.name) for m in ms})

    def test_observed_checks_are_reported_combined(self):
        """NOTE [the target's own check]: each check_step inside observe_checks reaches the observer."""
        seen = []
        with numerics.observe_checks(seen.append):
            first = numerics.check_step(numerics.as_step(_linear_step(False)()))
            second = numerics.check_step(numerics.as_step(_linear_step(True)()))
        numerics.check_step(numerics.as_step(_linear_step(True)()))  # outside: not observed
        self.assertEqual([{k: v for k, v in r.items() if k != "eager_comm"} for r in seen], [first, second])
        empty = {"forward": {}, "backward": {}}
        self.assertEqual(
            [r["eager_comm"] for r in seen],
            [
                {
                    "forward": {},
                    "backward": {},
                    "modules": {"Global": empty},
                    "modules_c10d": {"Global": empty},
                    "outside_root": [],
                }
            ]
            * 2,
        )  # no collective
        both = numerics.combine(seen)
        self.assertEqual(both["compared"], 10)
        self.assertEqual([m["index"] for m in both["mismatches"]], [5 + m["index"] for m in second["mismatches"]])
        self.assertEqual(numerics.combine([]), {"compared": 0, "mismatches": [], "eager_comm": {}})

    def test_mismatch_in_type_or_shape_is_named_not_compared(self):
        self.assertIsNone(numerics.compare("w", "grad", torch.ones(2), torch.ones(2), None, None))
        m = numerics.compare("w", "grad", torch.ones(2), None, None, None)
        self.assertEqual((m["detail"], m["max_abs"]), ("eager Tensor, compiled None", None))
        m = numerics.compare("w", "param", torch.ones(2), torch.ones(3), None, None)
        self.assertEqual(m["detail"], "eager torch.float32[2], compiled torch.float32[3]")
        m = numerics.compare("w", "param", torch.zeros(2), torch.tensor([0.0, 1e-3]), None, None)
        self.assertEqual(m["max_abs"], pytest.approx(1e-3))
        self.assertIsNone(numerics.compare("w", "param", torch.zeros(2), torch.tensor([0.0, 1e-3]), 0.0, 1e-2))

    def test_bad_make_step_results_are_clear_errors(self):
        with self.assertRaisesRegex(TypeError, r"make_step\(\) must return dynamo_ext.audit.Step or a \(model"):
            numerics.as_step(lambda c: None)
        with self.assertRaisesRegex(TypeError, "model must be a torch.nn.Module, got int"):
            numerics.as_step((1, None, lambda c: None))
        with self.assertRaisesRegex(ValueError, "give both rtol and atol"):
            audit(_two_breaks, torch.ones(4), backend="eager", check_numerics=_linear_step(False), rtol=1e-3)

    def test_numerics_round_trip_in_json(self):
        report = audit(_two_breaks, torch.ones(4), backend="eager", check_numerics=_linear_step(True))
        data = json.loads(json.dumps(report.to_json()))
        self.assertEqual(data["totals"]["numerics_mismatches"], 3)
        self.assertEqual(data["numerics"]["mismatches"][0]["name"], "loss")
        self.assertEqual(report_from_json(data), report)
