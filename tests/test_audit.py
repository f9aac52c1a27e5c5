"""Unit tests of the audit: merge, identity, ranking, JSON schema, diff and gate on hand-made events,
plus the in-process API (one process, no process group)."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
from expecttest import TestCase
from torch._dynamo.utils import counters

from dynamo_ext.audit import audit, diff_reports, gate, report_from_json
from dynamo_ext.audit.collector import collectives_in, parse_message
from dynamo_ext.audit.identity import break_id, fix_for, is_distributed_cause, normalize_path, user_frame_index
from dynamo_ext.audit.merge import merge


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


def comp(function="step", file="train.py", line=8, *, ops=5, recompile=None, colls=None, code_name=None):
    return {
        "ev": "compile",
        "compile_id": "0/0",
        "function": function,
        "code_name": code_name or function,
        "file": file,
        "line": line,
        "op_count": ops,
        "has_graph": True,
        "collectives": colls or {},
        "backward_collectives": {},
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

    def test_break_on_some_ranks_is_a_hang_risk(self):
        r = report_of({0: run_events(brk(), comp()), 1: run_events(comp())})
        self.assertTrue(r.graph_breaks[0].hang_risk)
        self.assertEqual(r.graph_breaks[0].ranks, (0,))
        self.assertEqual(len(r.hang_risks), 1)

    def test_different_counts_or_ops_are_hang_risks(self):
        r = report_of({0: run_events(brk(), brk(), comp(ops=5)), 1: run_events(brk(), comp(ops=6))})
        self.assertTrue(r.graph_breaks[0].hang_risk)
        self.assertTrue(r.graphs[0].hang_risk)
        self.assertEqual(r.graphs[0].op_count_by_rank, ((0, 5), (1, 6)))

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

    def test_frame_skip_counted_apart_from_graph_breaks(self):
        r = report_of({0: run_events(brk(kind="frame_skip"), brk(line=30))})
        self.assertEqual((r.ranks[0].graph_breaks, r.ranks[0].frame_skips), (1, 1))
        self.assertEqual(r.total_breaks, 2)


class TestIdentity(TestCase):
    def test_break_id(self):
        self.assertEqual(break_id("gb", "a/b.py", 3, "f"), "gb | a/b.py:3 | f")

    def test_normalize_path(self):
        self.assertEqual(normalize_path("/repo/pkg/m.py", cwd="/repo"), "pkg/m.py")
        self.assertEqual(
            normalize_path("/venv/lib/python3.11/site-packages/transformers/x.py", cwd="/repo"), "transformers/x.py"
        )
        self.assertEqual(normalize_path("<eval_with_key>.15", cwd="/repo"), "<fx-generated>")
        self.assertEqual(normalize_path("/elsewhere/m.py", cwd="/repo"), "/elsewhere/m.py")

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
        all_reduce = torch.ops._c10d_functional.all_reduce.default(x, 'sum', '0')
        wait_tensor = torch.ops._c10d_functional.wait_tensor.default(all_reduce)
        ag = torch.ops._c10d_functional.all_gather_into_tensor.default(y, 2, '0')
        ar2 = torch.ops._c10d_functional.all_reduce.default(z, 'sum', '1')
        """
        self.assertEqual(collectives_in(text), {"all_reduce": 2, "all_gather_into_tensor": 1})


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


  rank   status   breaks   skips   graphs   recompiles   compile s   counters
 ━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━━
  0      ok       1        0       1        0            0.50        ok
  1      ok       1        0       1        0            0.50        ok

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


class TestApi(TestCase):
    def test_counts_equal_dynamo_counters(self):
        report = audit(_two_breaks, torch.ones(4), backend="eager")
        self.assertEqual(report.ranks[0].graph_breaks, sum(counters["graph_break"].values()))
        self.assertEqual(report.ranks[0].graph_breaks, 2)
        lines = sorted(b.line for b in report.graph_breaks)
        first = _two_breaks.__code__.co_firstlineno
        self.assertEqual(lines, [first + 2, first + 3])
        self.assertTrue(
            all(b.file.endswith("test_audit.py") and b.function == "_two_breaks" for b in report.graph_breaks)
        )
        self.assertEqual(report.ranks[0].graphs, 3)
        self.assertEqual(
            sorted(b.source for b in report.graph_breaks), ["if x.sum().item() > 0:", 'print("audit api")']
        )

    def test_break_in_skipped_frame_still_counts(self):
        report = audit(_looped, torch.ones(4), backend="eager")
        self.assertEqual(sum(counters["graph_break"].values()), 0)  # Dynamo's counter misses it
        (b,) = report.graph_breaks
        self.assertEqual((b.kind, b.wrapper), ("frame_skip", "graph break in loop"))
        self.assertEqual(b.line, _looped.__code__.co_firstlineno + 3)
        self.assertEqual(report.total_breaks, 1)

    def test_target_exception_propagates(self):
        def boom(x):
            raise ValueError("boom")

        with pytest.raises(ValueError, match="boom"):
            audit(boom, torch.ones(2), backend="eager")
