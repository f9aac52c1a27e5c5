"""The communication report (tier 1, fake process group): collectives of compiled graphs with bytes, mesh axis,
user line, placements; the ring-traffic model; the --comm-budget gate; the JSON round trip.

The bundled example's report (every collective of its forward and compiled-autograd graphs, counts equal to
eager ``CommDebugMode``'s) is checked in tests/test_audit_example.py, on the audit's one 4-rank launch.
"""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
from helpers import fake_world, split_logs

from dynamo_ext.audit import audit, gate, report_from_json
from dynamo_ext.audit.rank.comm import _common_path, origin, traffic_bytes
from dynamo_ext.audit.rank.eager_comm import eager_kind
from dynamo_ext.audit.render.comm import human_bytes
from dynamo_ext.node_origin import user_frame


def test_ring_traffic_per_rank():
    assert traffic_bytes("all_gather", 100, 4) == (300, 300)
    assert traffic_bytes("reduce_scatter", 400, 4) == (300, 300)
    assert traffic_bytes("all_reduce", 400, 4) == (600, 600)
    assert traffic_bytes("all_to_all", 400, 4) == (300, 300)
    assert traffic_bytes("all_reduce", 400, 1) == (0, 0)


def test_generated_code_is_named_without_its_per_process_number():
    """NOTE [generated code has no per-process number]: two ranks whose FX made a different number of graph modules
    name the same generated line alike."""
    from dynamo_ext.node_origin import stack_frames

    trace = (
        '  File "<eval_with_key>.{}", line 7, in forward\n    all_reduce = torch.ops._c10d_functional.all_reduce(x)\n'
    )
    assert (
        user_frame(trace.format(12))
        == user_frame(trace.format(3))
        == (
            "<eval_with_key>",
            7,
            "forward",
            "all_reduce = torch.ops._c10d_functional.all_reduce(x)",
        )
    )
    assert stack_frames('  File "<eval_with_key>.12x", line 1, in f\n    y\n')[0][0] == "<eval_with_key>.12x"


def test_user_frame_skips_torch_and_plugin_frames():
    import os

    import dynamo_ext

    plugin = os.path.join(os.path.dirname(dynamo_ext.__file__), "variables", "fsdp", "hooks.py")
    tp = os.path.join(os.path.dirname(torch.__file__), "distributed", "tensor", "parallel", "style.py")
    st = (
        f'  File "/home/u/train.py", line 7, in forward\n    y = self.wo(x)\n'
        f'  File "{tp}", line 300, in _prepare_output_fn\n    outputs = outputs.redistribute()\n'
    )
    assert user_frame(st) == ("/home/u/train.py", 7, "forward", "y = self.wo(x)")
    only_plugin = f'  File "{plugin}", line 147, in pre_forward\n    x = 1\n'
    assert user_frame(only_plugin)[:2] == (plugin, 147)
    assert user_frame("") is None


def test_origin_names_the_plugins_fsdp_modules_and_torchs_fsdp_and_dtensor():
    """A collective is ``fsdp`` when a frame of its stack is in FSDP2 or in the plugin's ``variables/fsdp/``."""
    import os

    import dynamo_ext

    pkg = os.path.dirname(dynamo_ext.__file__)
    torch_dir = os.path.dirname(torch.__file__)

    def stack(*files):
        return "".join(f'  File "{f}", line 3, in f\n    x = 1\n' for f in ("/home/u/train.py", *files))

    for plugin in ("hooks.py", "groups.py", "reduce.py"):
        assert origin(stack(os.path.join(pkg, "variables", "fsdp", plugin))) == "fsdp", plugin
    assert origin(stack(os.path.join(torch_dir, "distributed", "fsdp", "_fully_shard", "_fsdp_param.py"))) == "fsdp"
    assert origin(stack(os.path.join(torch_dir, "distributed", "tensor", "_api.py"))) == "dtensor"
    assert origin(stack(os.path.join(pkg, "variables", "c10d", "collectives.py"))) == "explicit"
    assert origin(stack()) == "explicit"


def test_common_module_path_and_eager_kinds():
    assert _common_path("layers.0.attention.wq", "layers.1.attention.wq") == "layers.*.attention.wq"
    assert _common_path("layers.0", "layers.0") == "layers.0"
    assert _common_path("a.b.c", "a.x.c.d") == "a.*"
    assert eager_kind("c10d._allgather_base_") == "all_gather"
    assert eager_kind("c10d_functional.all_reduce") == "all_reduce"
    assert eager_kind("c10d._reduce_scatter_base_") == "reduce_scatter"
    assert human_bytes(1536) == "1.5 KiB"


def _step(x):
    from torch.distributed.tensor import Replicate

    y = x * 2
    z = y.redistribute(x.device_mesh, [Replicate()])  # the line the report names
    return (z.to_local() + 1).sum()


def test_compiled_redistribute_reported_with_axis_bytes_line_and_placements():
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    with fake_world(4):
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
        x = DTensor.from_local(torch.randn(8, 16), mesh["tp"], [Shard(0)], run_check=False)
        report = audit(_step, x, backend="aot_eager")
    comm = report.comm
    assert comm is not None
    fwd = [c for c in comm.collectives if c.graph_kind == "forward"]
    assert [c.op for c in fwd] == ["all_gather_into_tensor"], fwd
    c = fwd[0]
    assert (c.mesh_axis, c.group_size, c.kind) == ("tp", 2, "all_gather")
    assert (c.bytes_in, c.bytes_out, c.sent, c.received) == (8 * 16 * 4, 2 * 8 * 16 * 4, 8 * 16 * 4, 8 * 16 * 4)
    assert c.file.endswith("test_audit_comm.py") and c.source.startswith("z = y.redistribute("), c
    assert c.origin == "dtensor" and c.placements_basis == "graph", c
    assert (c.placements_before, c.placements_after) == ("(S(0))", "(R)")
    assert c.alternative and c.alternative_basis == "heuristic"
    assert c.est_ms is not None and c.est_ms > 0
    assert c.overlap_ops == 0  # the wait follows at once in an aot_eager graph
    assert comm.bytes_per_step == c.sent
    assert ("forward", "all_gather", 1) in comm.counts
    # the gate, and the JSON round trip
    assert gate(report, max_comm_bytes=c.sent) == []
    assert gate(report, max_comm_bytes=c.sent - 1) == [
        f"{c.sent} bytes sent per rank per step by collectives, budget --comm-budget {c.sent - 1}"
    ]
    back = report_from_json(json.loads(json.dumps(report.to_json())))
    assert back.comm == comm
    assert report.to_json()["totals"]["comm_bytes_per_step"] == c.sent
    text = str(report)
    assert "Communication" in text and "all_gather" in text and "tp(2)" in text
    assert "test_audit_comm.py:" in text and "[a1] S(0)->R" in text
    from dynamo_ext.audit.render.html import render_html

    page = render_html(report)
    assert page.count("<table id='comm'>") == 1 and "z = y.redistribute(" in page


def test_a_graph_the_analysis_fails_on_makes_the_report_incomplete_not_an_error(monkeypatch):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    from dynamo_ext.audit.rank.comm import CommTracer

    real = CommTracer.analyse

    def broken(self, gm, **kw):
        raise RuntimeError("boom")

    monkeypatch.setattr(CommTracer, "analyse", broken)
    with fake_world(4):
        mesh = init_device_mesh("cpu", (4,), mesh_dim_names=("tp",))
        x = DTensor.from_local(torch.randn(8, 16), mesh, [Shard(0)], run_check=False)
        report = audit(_step, x, backend="aot_eager")
    monkeypatch.setattr(CommTracer, "analyse", real)
    assert report.errors == ()
    assert report.comm.missing == ("rank 0: aot_inference_graph: analysis failed: RuntimeError: boom",)
    assert report.comm.collectives == ()
    assert gate(report, max_comm_bytes=10**9) == [
        "--comm-budget 1000000000 cannot be checked: the communication report is incomplete "
        "(rank 0: aot_inference_graph: analysis failed: RuntimeError: boom)"
    ]
    assert "INCOMPLETE communication report" in str(report)


def test_report_without_comm_reads_back_and_passes_a_budget():
    from dynamo_ext.audit.model.records import AuditReport

    r = AuditReport("t", 1, "", "", {}, (), (), (), ())
    assert gate(r, max_comm_bytes=0) == []
    assert report_from_json(r.to_json()).comm is None
    assert dataclasses.replace(r).comm is None


@pytest.mark.parametrize("bad", ["-1"])
def test_cli_rejects_a_negative_budget(bad, capsys):
    from dynamo_ext.audit.cli import main

    assert main(["audit", "--comm-budget", bad, "x:y"]) == 2
    assert "--comm-budget must be a number of bytes >= 0, got -1" in capsys.readouterr().err


def _explicit(x):
    import torch.distributed as dist
    import torch.distributed._functional_collectives as funcol

    y = funcol.all_reduce(x, "sum", dist.group.WORLD)
    z = x * 3 + 1  # independent of y: runs before y's wait
    b = funcol.broadcast(z, 0, dist.group.WORLD)
    return y + b


def test_explicit_collectives_bytes_overlap_and_unmodelled_time(monkeypatch):
    from dynamo_ext.audit.rank.comm import INTRA_BW_ENV

    x = torch.randn(4, 8)
    with fake_world(4):
        report = audit(_explicit, x, backend="aot_eager")
        monkeypatch.setenv(INTRA_BW_ENV, "0.001")  # GB/s, as --intra-node-bw: far slower than the default
        slow = audit(_explicit, x, backend="aot_eager")
    assert slow.comm.collectives[0].est_ms > report.comm.collectives[0].est_ms
    colls = report.comm.collectives
    assert [(c.op, c.origin, c.mesh_axis, c.group_size) for c in colls] == [
        ("all_reduce", "explicit", "", 4),
        ("broadcast", "explicit", "", 4),
    ]
    ar, bc = colls
    assert (ar.bytes_in, ar.sent) == (128, 2 * 3 * 128 // 4)
    assert ar.overlap_ops == 0  # Dynamo waits at once; only a scheduler (Inductor) moves the wait
    assert ar.source.startswith("y = funcol.all_reduce(") and ar.est_ms > 0
    assert bc.est_ms is None  # comm_analysis does not model broadcast
    assert (bc.sent, bc.received) == (128, 128)
    assert report.comm.bytes_per_step == ar.sent + bc.sent


class _Dispatch:
    """Holds an expert-parallel mesh, as transformers' ``AllToAllEP`` does (``self.ep_mesh``)."""

    def __init__(self, mesh) -> None:
        self.ep_mesh = mesh

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        import torch.distributed._functional_collectives as funcol

        return funcol.all_to_all_single(x, None, None, self.ep_mesh.get_group()) + 1


def test_explicit_collective_on_a_mesh_group_is_named_by_its_axis(plugin):
    """No DTensor of the mesh in the graph: the axis comes from the mesh the compiled frame used."""
    from torch.distributed.device_mesh import init_device_mesh

    with fake_world(4):
        dense = init_device_mesh("cpu", (2, 2), mesh_dim_names=("fsdp", "tp"))
        experts = init_device_mesh("cpu", (2, 2), mesh_dim_names=("efsdp", "ep"))
        assert dense["tp"].get_group().group_name != experts["ep"].get_group().group_name  # same ranks, other group
        report = audit(_Dispatch(experts["ep"]), torch.randn(4, 8), backend="aot_eager")
    (c,) = report.comm.collectives
    assert (c.op, c.origin, c.mesh_axis, c.group_size) == ("all_to_all_single", "explicit", "ep", 2), c


def test_a_mesh_of_an_earlier_world_names_no_axis(plugin):
    """Group names restart with a new world: a still-alive mesh traced in the old one must not name their axes."""
    from torch.distributed.device_mesh import init_device_mesh

    from dynamo_ext.variables.device_mesh import traced_meshes

    with fake_world(4):
        old = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp_old", "tp_old"))["tp_old"]
        audit(_Dispatch(old), torch.randn(4, 8), backend="aot_eager")
        assert any(m is old for m in traced_meshes())
    with fake_world(4):
        assert not any(m is old for m in traced_meshes())  # `old` is alive, but of the destroyed world
        report = audit(_Dispatch(dist_group_world()), torch.randn(4, 8), backend="aot_eager")
    (c,) = report.comm.collectives
    assert c.mesh_axis == "", c


def dist_group_world():
    """A stand-in for a mesh axis: ``get_group()`` gives the (new) world group."""
    import torch.distributed as dist

    return type("World", (), {"get_group": staticmethod(lambda: dist.group.WORLD)})()


def test_overlap_counts_compute_between_a_collective_and_its_wait():
    import torch.distributed as dist

    from dynamo_ext.audit.rank.comm import CommTracer

    with fake_world(4):
        group = dist.group.WORLD.group_name
        g = torch.fx.Graph()
        x = g.placeholder("x")
        ar = g.call_function(torch.ops._c10d_functional.all_reduce.default, (x, "sum", group))
        m = g.call_function(torch.ops.aten.mul.Tensor, (x, 3))
        a = g.call_function(torch.ops.aten.add.Tensor, (m, 1))
        w = g.call_function(torch.ops._c10d_functional.wait_tensor.default, (ar,))
        g.output(g.call_function(torch.ops.aten.add.Tensor, (w, a)))
        val = torch.empty(4, 8)
        for n in (x, ar, m, a, w):
            n.meta["val"] = val
        (rec,) = CommTracer().analyse(torch.fx.GraphModule(torch.nn.Module(), g), phase="forward")
    assert (rec["op"], rec["group_size"], rec["overlap_ops"]) == ("all_reduce", 4, 2)
    assert (rec["file"], rec["origin"]) == ("", "unknown")  # no stack trace: said so, nothing made up


def _coll(index, op, kind, origin="fsdp", module="layers.0", sent=100):
    return {
        "index": index, "node": f"n{index}", "op": op, "kind": kind, "group": "1", "group_size": 2,
        "group_ranks": [0, 2], "mesh_axis": "dp", "dtype": "float32", "shape_in": [4], "shape_out": [8],
        "bytes_in": sent, "bytes_out": 2 * sent, "sent": sent, "received": sent, "est_ms": 0.01,
        "overlap_ops": 0, "file": "train.py", "line": 3, "function": "f", "source": "y = m(x)",
        "module": module, "origin": origin, "placements_before": "", "placements_after": "",
        "placements_basis": "", "alternative": "", "alternative_basis": "",
    }  # fmt: skip


def test_merge_counts_fsdp_per_group_and_leaves_inlined_backward_out():
    from dynamo_ext.audit.merge.merger import merge

    def compile_ev(cid):
        return {
            "ev": "compile", "compile_id": cid, "function": "f", "code_name": "f", "file": "train.py", "line": 1,
            "op_count": 9, "has_graph": True, "collectives": {}, "backward_collectives": {},
            "collective_sequence": [], "backward_collective_sequence": [], "time_s": 0.1,
            "recompile_reason": None, "fail_type": None, "fail_reason": None, "phase": "forward",
        }  # fmt: skip

    def events(rank):
        ag = [_coll(i, "all_gather_into_tensor", "all_gather") for i in range(3)]  # one FSDP group, 3 params
        tp = _coll(3, "all_reduce", "all_reduce", origin="dtensor", module="layers.0.wo")
        rs = [_coll(i, "reduce_scatter_tensor", "reduce_scatter", sent=50 + rank) for i in range(2)]
        return [
            compile_ev("0/0"),
            {"ev": "comm_graph", "compile_id": "0/0", "graph": "forward", "aot_id": 0, "inlined_aot_ids": [],
             "collectives": [*ag, tp]},
            {"ev": "comm_graph", "compile_id": "0/0", "graph": "backward", "aot_id": 0, "inlined_aot_ids": [],
             "collectives": rs},
            {"ev": "comm_graph", "compile_id": "!0/0/0", "graph": "compiled_autograd", "aot_id": 1,
             "inlined_aot_ids": [0], "collectives": rs},
            {"ev": "end", "counters": {}},
            {"ev": "numerics", "compared": 1, "mismatches": [],
             "eager_comm": {"forward": {"all_gather": 1, "all_reduce": 1}, "backward": {"reduce_scatter": 1}}},
        ]  # fmt: skip

    report = merge({0: events(0), 1: events(1)}, target="t", world_size=2, backend="")
    comm = report.comm
    assert (
        comm.counts
        == comm.eager_counts
        == (
            ("backward", "reduce_scatter", 1),
            ("forward", "all_gather", 1),
            ("forward", "all_reduce", 1),
        )
    )
    inlined = [c for c in comm.collectives if c.inlined]
    assert [c.graph_kind for c in inlined] == ["backward", "backward"]
    ca = [c for c in comm.collectives if c.graph_kind == "compiled_autograd"]
    assert [c.sent_by_rank for c in ca] == [((0, 50), (1, 51))] * 2 and ca[0].sent == 51 and ca[0].ranks == (0, 1)
    # per rank: 3 all-gathers + 1 all-reduce of 100 bytes, 2 reduce-scatters of 50 + rank; inlined ones not counted
    assert comm.bytes_by_rank == ((0, 400 + 100), (1, 400 + 102)) and comm.bytes_per_step == 502
    assert {(m.module, m.phase, m.count) for m in comm.modules} == {
        ("layers.0", "forward", 3),
        ("layers.0.wo", "forward", 1),
        ("layers.0", "backward", 2),
    }
    assert comm.missing == ()


class _Block(torch.nn.Module):
    def forward(self, x):
        from torch.distributed.tensor import Replicate, Shard

        y = (x * 2).redistribute(x.device_mesh, [Replicate()])  # one all-gather per block
        return y.redistribute(x.device_mesh, [Shard(0)]) + 1


class _Blocks(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = torch.nn.ModuleList(_Block() for _ in range(3))

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x.to_local().sum()


def test_in_process_audit_compiles_every_block_and_counts_its_collectives(plugin):
    """NOTE [the audit compiles each block]: three identical blocks, each its own all-gather in the report.

    With a block running an identical block's compile, that block logged no graphs of its own: the report
    had two all-gathers (``layers.0``, ``layers.1``).  The graph is still cut at its blocks, as a run cuts it.
    """
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    from dynamo_ext.audit.schema.events import BLOCKS_EACH_FOR_AUDIT

    with fake_world(4), split_logs() as records:
        mesh = init_device_mesh("cpu", (4,), mesh_dim_names=("tp",))
        x = DTensor.from_local(torch.randn(8, 16), mesh, [Shard(0)], run_check=False)
        report = audit(_Blocks(), x, backend="aot_eager")
    gathers = [c for c in report.comm.collectives if c.kind == "all_gather"]
    assert sorted(c.module for c in gathers) == ["layers.0", "layers.1", "layers.2"], gathers
    assert records == [
        "blocks compiled once: 4 submodules, 4 compiled, 0 running an identical block's compile "
        "(config.reuse_block_compiles off)"
    ]
    assert report.plugin["blocks"] == BLOCKS_EACH_FOR_AUDIT
    assert "plugin: graphs with repeated blocks cut at them as a run cuts them" in str(report)  # (rich wraps it)
