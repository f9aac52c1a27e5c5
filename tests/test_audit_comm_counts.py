"""The communication report's counts against eager ``CommDebugMode``'s: each difference carries a reason, or MISMATCH.

Tier 1 on merged rank events (NOTE [count differences] in dynamo_ext/audit/comm_explain.py); the real runs are
tests/test_audit_titan_llama.py (FSDP2 prefetch, activation-checkpoint recomputation) and
tests/test_audit_example.py (counts equal); one small real run here (a module behind a graph break).
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

import pytest
from test_audit_comm import _coll
from test_audit_e2e import REPO, TARGETS, cli, marker_line

from dynamo_ext.audit.merge.merger import merge
from dynamo_ext.audit.rank.eager_comm import eager_module_path
from dynamo_ext.audit.render.comm import counts_line


def _compile(cid: str, function: str) -> dict:
    return {
        "ev": "compile", "compile_id": cid, "function": function, "code_name": function, "file": "train.py",
        "line": 1, "op_count": 9, "has_graph": True, "collectives": {}, "backward_collectives": {},
        "collective_sequence": [], "backward_collective_sequence": [], "time_s": 0.1, "recompile_reason": None,
        "fail_type": None, "fail_reason": None, "phase": "forward",
    }  # fmt: skip


def _events(eager_layers_all_reduce: int = 2) -> list[dict]:
    """One rank: the model's graph (layers.0's FSDP2 group traced), a hook's graph, and the eager step's counts.

    Eager: layers.0 as compiled; ``norm`` (an FSDP2 group whose hooks ran eagerly) all-gathers in the forward
    and reduce-scatters in the backward; ``output``'s input hook all-gathers (compiled as a frame of its own,
    so its graph has no module).
    """
    fsdp_ag = [_coll(i, "all_gather_into_tensor", "all_gather") for i in range(3)]  # one FSDP group, 3 params
    norm_ar = [_coll(i, "all_reduce", "all_reduce", module="layers.0") for i in range(2)]  # 2 norm weights
    hook_ag = _coll(0, "all_gather_into_tensor", "all_gather", origin="dtensor", module="")
    eager_modules = {
        "Global": {"forward": {"all_gather": 3}, "backward": {"all_reduce": eager_layers_all_reduce, "reduce_scatter": 1}},
        "<root>": {"forward": {"all_gather": 3}, "backward": {"all_reduce": eager_layers_all_reduce, "reduce_scatter": 1}},
        "layers.0": {"forward": {"all_gather": 1}, "backward": {"all_reduce": eager_layers_all_reduce}},
        "layers.0.attention_norm": {"forward": {}, "backward": {"all_reduce": 1}},
        "norm": {"forward": {"all_gather": 1}, "backward": {"reduce_scatter": 1}},
        "output": {"forward": {"all_gather": 1}, "backward": {}},
    }  # fmt: skip
    return [
        _compile("0/0", "forward"),
        _compile("1/0", "<lambda>"),
        {"ev": "comm_graph", "compile_id": "0/0", "graph": "forward", "aot_id": 0, "inlined_aot_ids": [],
         "collectives": fsdp_ag},
        {"ev": "comm_graph", "compile_id": "0/0", "graph": "backward", "aot_id": 0, "inlined_aot_ids": [],
         "collectives": norm_ar},
        {"ev": "comm_graph", "compile_id": "1/0", "graph": "forward", "aot_id": 1, "inlined_aot_ids": [],
         "collectives": [hook_ag]},
        {"ev": "end", "counters": {}},
        {"ev": "numerics", "compared": 1, "mismatches": [],
         "eager_comm": {**{ph: eager_modules["Global"][ph] for ph in ("forward", "backward")},
                        "modules": eager_modules}},
    ]  # fmt: skip


def test_every_count_difference_has_a_reason_per_module():
    comm = merge({0: _events(), 1: _events()}, target="t", world_size=2, backend="").comm
    # FSDP2's all-gathers once per group, its per-parameter all-reduces (gradients Partial over "tp") each
    assert comm.counts == (("backward", "all_reduce", 2), ("forward", "all_gather", 2))
    assert comm.eager_counts == (
        ("backward", "all_reduce", 2),
        ("backward", "reduce_scatter", 1),
        ("forward", "all_gather", 3),
    )
    diffs = {(d.phase, d.kind): d for d in comm.count_differences}
    assert set(diffs) == {("backward", "reduce_scatter"), ("forward", "all_gather")}
    assert all(d.unexplained == "" for d in diffs.values())
    rs = diffs["backward", "reduce_scatter"]
    assert (rs.compiled, rs.eager) == (0, 1)
    assert rs.reasons == ("norm: compiled 0, eager 1: no compiled graph has a collective of it: ran eagerly",)
    ag = diffs["forward", "all_gather"]
    assert (ag.compiled, ag.eager) == (2, 3)
    assert ag.reasons == (
        "norm: compiled 0, eager 1: no compiled graph has a collective of it: ran eagerly, or in a graph of no "
        "module (outside any module)",
        "output: compiled 0, eager 1: no compiled graph has a collective of it: ran eagerly, or in a graph of no "
        "module (outside any module)",
        "outside any module: compiled 1, eager 0: compiled in a graph of no module (train.py:1 <lambda>: a hook or "
        "function compiled as a frame of its own); eager counts it in the module whose hook ran it",
    )
    text, ok = counts_line(comm)
    assert ok is True and "differs, for these reasons:" in text and "MISMATCH" not in text, text
    assert "\n  backward reduce_scatter: compiled 0, eager 1\n    norm: compiled 0, eager 1: " in text, text


def test_a_difference_without_a_reason_is_a_mismatch():
    comm = merge({0: _events(eager_layers_all_reduce=3)}, target="t", world_size=1, backend="").comm
    (ar,) = [d for d in comm.count_differences if d.kind == "all_reduce"]
    # each side's count by kind: what to look at
    unexplained = (
        "layers.0: compiled 2, eager 3 (compiled: 2 FSDP2's or explicit, 0 DTensor's; eager: 0 c10d, 3 functional)"
    )
    assert (ar.compiled, ar.eager, ar.reasons, ar.unexplained) == (2, 3, (), unexplained)
    text, ok = counts_line(comm)
    assert ok is False and "MISMATCH" in text and "    unexplained: " + unexplained in text, text


def test_an_eager_backward_and_graph_breaks_named_in_reasons():
    from dynamo_ext.audit.merge.comm_explain import explain_counts

    eager = {"Global": {"backward": {"reduce_scatter": 2}}, "<root>": {"backward": {"reduce_scatter": 2}},
             "layers.0": {"backward": {"reduce_scatter": 1}}, "layers.1": {"backward": {"reduce_scatter": 1}}}  # fmt: skip
    (d,) = explain_counts({}, {("backward", "reduce_scatter"): 2}, eager, [], [], ["train.py:7"])
    assert d.reasons == (
        "layers.0: compiled 0, eager 1: the backward ran eagerly, its collectives are in no compiled graph",
        "layers.1: compiled 0, eager 1: the backward ran eagerly, its collectives are in no compiled graph",
    )
    (d,) = explain_counts({}, {("backward", "reduce_scatter"): 2}, None, [], [], [])
    assert d.unexplained == "compiled 0, eager 2: no per-module eager count"
    # layers.0's backward compiled (an all-reduce), layers.1's not: it ran eagerly, around the graph breaks
    colls = list(merge({0: _events()}, target="t", world_size=1, backend="").comm.collectives)
    (d,) = explain_counts({}, {("backward", "reduce_scatter"): 2}, eager, colls, [], ["train.py:7", "train.py:9"])
    assert d.reasons == (
        "layers.1: compiled 0, eager 1: no compiled graph has a collective of it: ran eagerly (graph breaks at "
        "train.py:7, train.py:9)",
    )
    assert (
        d.unexplained
        == "layers.0: compiled 0, eager 1 (compiled: 0 FSDP2's or explicit, 0 DTensor's; eager: 0 c10d, 1 functional)"
    )  # layers.0 has compiled backward collectives


def test_fsdp_hooks_run_eagerly_around_compiled_blocks_are_the_c10d_surplus():
    """Each block compiled on its own (torchtitan's way): DTensor's gathers compiled, FSDP2's hooks eager (c10d ops)."""
    tp_ag = [_coll(i, "all_gather_into_tensor", "all_gather", origin="dtensor", module="layers.0.attention")
             for i in range(2)]  # fmt: skip
    modules = {"Global": {"forward": {"all_gather": 3}}, "<root>": {"forward": {"all_gather": 3}},
               "layers.0": {"forward": {"all_gather": 3}}}  # fmt: skip
    c10d = {"Global": {"forward": {"all_gather": 1}}, "<root>": {"forward": {"all_gather": 1}},
            "layers.0": {"forward": {"all_gather": 1}}}  # fmt: skip
    events = [
        _compile("0/0", "forward"),
        {"ev": "comm_graph", "compile_id": "0/0", "graph": "forward", "aot_id": 0, "inlined_aot_ids": [],
         "collectives": tp_ag},
        {"ev": "end", "counters": {}},
        {"ev": "numerics", "compared": 1, "mismatches": [],
         "eager_comm": {"forward": {"all_gather": 3}, "backward": {}, "modules": modules, "modules_c10d": c10d}},
    ]  # fmt: skip
    (d,) = merge({0: events}, target="t", world_size=1, backend="").comm.count_differences
    assert (d.compiled, d.eager, d.unexplained) == (2, 3, "")
    assert d.reasons == (
        "layers.0: compiled 2, eager 3: its 1 c10d collective(s) (FSDP2's hooks, explicit dist calls) ran eagerly, "
        "outside the compiled graphs, which have its 2 DTensor one(s)",
    )
    # without the c10d split the same difference cannot be told apart from a wrong count
    del events[-1]["eager_comm"]["modules_c10d"]
    (d,) = merge({0: events}, target="t", world_size=1, backend="").comm.count_differences
    assert (
        d.unexplained
        == "layers.0: compiled 2, eager 3 (compiled: 0 FSDP2's or explicit, 2 DTensor's; eager: 0 c10d, 3 functional)"
    )


def _one_graph(forward: list[dict], backward: list[dict], modules: dict, c10d: dict) -> list[dict]:
    """One rank, one compiled graph (forward + AOT backward), and the eager step's per-module counts."""
    glob = modules["Global"]
    return [
        _compile("0/0", "forward"),
        {"ev": "comm_graph", "compile_id": "0/0", "graph": "forward", "aot_id": 0, "inlined_aot_ids": [],
         "collectives": forward},
        {"ev": "comm_graph", "compile_id": "0/0", "graph": "backward", "aot_id": 0, "inlined_aot_ids": [],
         "collectives": backward},
        {"ev": "end", "counters": {}},
        {"ev": "numerics", "compared": 1, "mismatches": [],
         "eager_comm": {"forward": glob["forward"], "backward": glob["backward"], "modules": modules,
                        "modules_c10d": c10d}},
    ]  # fmt: skip


def test_fsdp2_backward_gathers_where_eager_prefetches_them_are_no_eager_run():
    """Traced FSDP2, no break: eager counts a unit's backward gather in the unit after it (prefetch), gathers more.

    ``tok`` (an embedding: its backward uses no weight), ``layers.0`` (resharded after forward, re-gathered)
    and ``head`` (a module group kept unsharded): the compiled backward gathers layers.0's parameters only;
    eager FSDP2 gathers layers.0's in head's backward hook and tok's in layers.0's.  ``head`` has no compiled
    backward collective, yet nothing ran eagerly.
    """
    ag = "all_gather_into_tensor"
    forward = [_coll(0, ag, "all_gather", module="tok"), _coll(1, ag, "all_gather", module="layers.0"),
               _coll(2, ag, "all_gather", module="layers.0"), _coll(3, ag, "all_gather", module="head")]  # fmt: skip
    backward = [_coll(0, ag, "all_gather", module="layers.0"), _coll(1, ag, "all_gather", module="layers.0")]
    modules = {"Global": {"forward": {"all_gather": 3}, "backward": {"all_gather": 2}},
               "<root>": {"forward": {"all_gather": 3}, "backward": {"all_gather": 2}},
               "tok": {"forward": {"all_gather": 1}, "backward": {}},
               "layers.0": {"forward": {"all_gather": 1}, "backward": {"all_gather": 1}},
               "head": {"forward": {"all_gather": 1}, "backward": {"all_gather": 1}}}  # fmt: skip
    events = _one_graph(forward, backward, modules, modules)  # every eager collective is FSDP2's (c10d)
    comm = merge({0: events}, target="t", world_size=1, backend="").comm
    (d,) = comm.count_differences
    assert (d.phase, d.kind, d.compiled, d.eager, d.unexplained) == ("backward", "all_gather", 1, 2, "")
    assert d.reasons == (
        "head: compiled 0, eager 1: FSDP2's all_gathers differ (compiled 0, eager 1), DTensor's agree",
        "FSDP2's backward all_gathers in all: compiled 1 (layers.0 1), eager 2 (head 1, layers.0 1): eager FSDP2 "
        "all-gathers a unit's parameters for its backward ahead, in the backward hook of the unit after it in "
        "forward order (prefetch), where CommDebugMode counts it, and re-gathers every unit it resharded after "
        "forward; the compiled backward gathers a unit's parameters where its backward uses them, and not those "
        "of head, tok (kept from the forward, reshard_after_forward=False, or unused by the backward, as an "
        "embedding's weight)",
    )
    assert not any("eagerly" in r for r in d.reasons)
    # behind a graph break the same counts are FSDP2's hooks run eagerly: that reason stays
    from dynamo_ext.audit.merge.comm_explain import explain_counts

    (d,) = explain_counts(
        dict([((p, k), n) for p, k, n in comm.counts]), {("backward", "all_gather"): 2, ("forward", "all_gather"): 3},
        modules, list(comm.collectives), list(comm.collectives), ["train.py:7"], eager_c10d=modules,
    )  # fmt: skip
    assert d.reasons == ("head: compiled 0, eager 1: no compiled graph has a collective of it: ran eagerly (graph "
                         "breaks at train.py:7)",)  # fmt: skip


def test_activation_checkpoint_recompute_is_the_backward_surplus():
    """layers.1's compiled backward reruns its forward reduce-scatter (its output is saved by eager, recomputed here)."""
    rs = "reduce_scatter_tensor"
    forward = [_coll(0, rs, "reduce_scatter", origin="dtensor", module="layers.0.w2"),
               _coll(1, rs, "reduce_scatter", origin="dtensor", module="layers.1.w2")]  # fmt: skip
    grads = [_coll(i, rs, "reduce_scatter", origin="dtensor", module=f"layers.{i}.ff") for i in (0, 1)]
    for c in grads:
        c["line"] = 5  # the input gradient's reduce-scatter: another line than any forward one
    recompute = _coll(2, rs, "reduce_scatter", origin="dtensor", module="layers.1.w2")
    modules = {"Global": {"forward": {"reduce_scatter": 2}, "backward": {"reduce_scatter": 2}},
               "<root>": {"forward": {"reduce_scatter": 2}, "backward": {"reduce_scatter": 2}},
               "layers.0": {"forward": {"reduce_scatter": 1}, "backward": {"reduce_scatter": 1}},
               "layers.1": {"forward": {"reduce_scatter": 1}, "backward": {"reduce_scatter": 1}}}  # fmt: skip
    c10d = {m: {"forward": {}, "backward": {}} for m in modules}
    (d,) = merge({0: _one_graph(forward, [*grads, recompute], modules, c10d)}, target="t", world_size=1,
                 backend="").comm.count_differences  # fmt: skip
    assert (d.phase, d.kind, d.compiled, d.eager, d.unexplained) == ("backward", "reduce_scatter", 3, 2, "")
    assert d.reasons == (
        "layers.1: compiled 2, eager 1: its compiled backward recomputes 1 of its forward reduce_scatter(s) "
        "(layers.1.w2), 1 more than eager's backward: activation checkpointing, whose eager recomputation stops "
        "once the region's saved tensors are rebuilt, while the compiled partitioner recomputes a checkpointed "
        "output that later code's backward needs instead of saving it",
    )
    # another shape is no rerun of the forward's: the surplus stays unexplained
    recompute["shape_in"] = [8]
    (d,) = merge({0: _one_graph(forward, [*grads, recompute], modules, c10d)}, target="t", world_size=1,
                 backend="").comm.count_differences  # fmt: skip
    assert (d.reasons, d.unexplained) == (
        (),
        "layers.1: compiled 2, eager 1 (compiled: 0 FSDP2's or explicit, 2 DTensor's; eager: 0 c10d, 1 functional)",
    )


def test_eager_module_names_as_the_report_writes_them():
    assert eager_module_path("Transformer.layers.0._checkpoint_wrapped_module.attention") == "layers.0.attention"
    assert eager_module_path("Transformer") == "<root>"
    assert eager_module_path("Global") == "Global"


@pytest.mark.gloo
def test_module_run_eagerly_behind_a_break_is_the_reason_on_a_real_run():
    """2 gloo ranks: ``second``'s FSDP2 collectives run eagerly behind a break; the report names it, nothing else."""
    target = TARGETS / "eager_fsdp_module.py"
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "out.json"
        proc = cli("--nproc", "2", "--check-numerics", "--quiet", "--json", str(out), str(target.relative_to(REPO)))
        assert proc.returncode == 0, proc.stderr[-3000:]
        comm = json.loads(out.read_text())["comm"]
    assert comm["counts"] == [["backward", "reduce_scatter", 1], ["forward", "all_gather", 1]]  # `first`, traced
    diffs = {(d["phase"], d["kind"]): d for d in comm["count_differences"]}
    assert set(diffs) == {("forward", "all_gather"), ("backward", "reduce_scatter"), ("backward", "all_gather")}
    brk = f"graph breaks at tests/audit_targets/eager_fsdp_module.py:{marker_line(target, '# the graph break')}"
    assert diffs["forward", "all_gather"]["reasons"] == [
        f"second: compiled 0, eager 1: no compiled graph has a collective of it: ran eagerly ({brk})"
    ]
    for d in diffs.values():
        assert d["unexplained"] == "" and d["eager"] > d["compiled"], d
        assert [r.split(":")[0] for r in d["reasons"]] == ["second"], d
