"""The audit's training steps: the state saved and put back, a step target trained by the audit, counted per step,
its steps checked against eager from one build; module names by identity (tier 1, one process)."""

from __future__ import annotations

import json
import textwrap
from types import SimpleNamespace

import pytest
import torch
from helpers import fake_world
from test_audit import brk, comp
from test_audit_comm import _coll
from torch import nn

from dynamo_ext.audit import Step, audit, report_from_json
from dynamo_ext.audit.merge.merger import merge
from dynamo_ext.audit.rank import module_names, state
from dynamo_ext.audit.rank.numerics import as_step, compare_runs, run_step
from dynamo_ext.audit.rank.steps import OptimizerSteps


def _trainer(seed=0):
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4), nn.Linear(4, 1))
    optim = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    sched = torch.optim.lr_scheduler.StepLR(optim, step_size=1, gamma=0.5)

    def step(compiled):
        # The batch follows the scheduler, and dropout-like noise the RNG: both must be put back.
        x = torch.randn(8, 4) + sched.last_epoch
        loss = model(x).square().mean()
        loss.backward()
        return {"loss": loss}

    return Step(model, optim, step, lr_scheduler=sched)


def test_saved_state_puts_back_parameters_buffers_optimizer_scheduler_and_rng():
    spec = _trainer()
    saved = state.save(spec.model, spec.optimizer, spec.lr_scheduler)
    first = [run_step(spec, compiled=False) for _ in range(2)]
    assert spec.lr_scheduler.last_epoch == 2 and spec.optimizer.state  # momentum buffers made
    state.restore(saved, spec.model, spec.optimizer, spec.lr_scheduler)
    assert spec.lr_scheduler.last_epoch == 0 and spec.optimizer.param_groups[0]["lr"] == 0.1
    assert not spec.optimizer.state and all(p.grad is None for p in spec.model.parameters())
    again = [run_step(spec, compiled=False) for _ in range(2)]
    result = compare_runs(first, again, rtol=0.0, atol=0.0)
    assert result == {"compared": 2 * (1 + 6 + 6), "mismatches": []}  # loss, 6 grads, 6 params, per step


def test_without_the_scheduler_restored_the_second_run_differs_in_its_step():
    spec = _trainer()
    saved = state.save(spec.model, spec.optimizer)  # the scheduler's state left out
    first = [run_step(spec, compiled=False) for _ in range(2)]
    state.restore(saved, spec.model, spec.optimizer)
    again = [run_step(spec, compiled=False) for _ in range(2)]
    mismatches = compare_runs(first, again, rtol=0.0, atol=0.0)["mismatches"]
    assert mismatches and mismatches[0]["step"] == 1 and mismatches[0]["name"] == "loss", mismatches[:2]


def test_restore_into_another_model_names_the_tensor():
    spec = _trainer()
    saved = state.save(spec.model)
    with pytest.raises(
        ValueError, match=r"cannot restore parameter '0.weight': the saved state has \[4, 4\], the model \[3, 4\]"
    ):
        state.restore(saved, nn.Sequential(nn.Linear(4, 3)))


def test_as_step_takes_a_scheduler_and_names_what_a_bad_one_lacks():
    spec = _trainer()
    four = as_step((spec.model, spec.optimizer, spec.step, spec.lr_scheduler))
    assert four.lr_scheduler is spec.lr_scheduler
    with pytest.raises(TypeError, match=r"lr_scheduler must have step\(\), state_dict\(\) and load_state_dict\(\).* "
                       r"got object without step, state_dict, load_state_dict\(\)"):  # fmt: skip
        as_step((spec.model, spec.optimizer, spec.step, object()))


def _second_step_off(tolerances=None):
    """A step whose compiled run differs from eager by 1% in its second step only (the loss scaled)."""
    torch.manual_seed(0)
    model = nn.Linear(4, 1)
    optim = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    sched = torch.optim.lr_scheduler.StepLR(optim, step_size=1, gamma=0.5)
    x = torch.randn(8, 4)

    def step(compiled):
        loss = model(x).square().mean()
        if compiled and sched.last_epoch == 1:
            loss = loss * 1.01
        loss.backward()
        return {"loss": loss}

    return Step(model, optim, step, lr_scheduler=sched, tolerances=tolerances)


def test_each_eager_step_starts_from_its_compiled_steps_state_and_tolerances_apply_by_pattern():
    from dynamo_ext.audit.rank.steps import check, train

    sink = SimpleNamespace(step=None)
    trained = train(_second_step_off(), 3, sink, keep=True)
    assert sink.step == 3 and len(trained.saved) == 3
    result = check(trained, None, None)
    # Step 3 starts from the compiled step 2's state in both runs: only step 2 differs (loss, 2 grads, 2 params).
    assert {(m["step"], m["kind"]) for m in result["mismatches"]} == {(2, "output"), (2, "grad"), (2, "param")}
    events = [{"ev": "start"}, {"ev": "numerics", **result}, {"ev": "end", "counters": {}}]
    first = merge({0: events}, target="t", world_size=1, backend="").numerics.first
    assert str(first).startswith("step 2: output loss on rank 0: max abs error"), str(first)
    assert result["compared"] == 3 * 5 and result["steps"] == 3 and result["tolerances"] == []
    # The target's tolerance for what it knows differs, by pattern; the first match wins.
    tolerant = _second_step_off({"output:*": (0.02, 0.0), "grad:x": (1.0, 1.0)})
    result = check(train(tolerant, 3, sink, keep=True), None, None)
    assert {(m["step"], m["kind"]) for m in result["mismatches"]} == {(2, "grad"), (2, "param")}
    assert result["tolerances"] == ["output:*: rtol 0.02, atol 0", "grad:x: rtol 1, atol 1"]
    result = check(train(_second_step_off({"output:*": (0.02, 0.0)}), 3, sink, keep=True), 0.0, 0.0)
    assert result["tolerances"] == [] and {m["kind"] for m in result["mismatches"]} == {"output", "grad", "param"}


def test_tolerances_are_checked_and_matched():
    from dynamo_ext.audit.rank.numerics import tolerance

    spec = _trainer()
    with pytest.raises(TypeError, match=r"tolerances must map a pattern such as 'grad:\*norm.weight' to \(rtol, "
                       r"atol\), two numbers >= 0; got 'grad:\*': 0.1"):  # fmt: skip
        as_step(Step(spec.model, spec.optimizer, spec.step, tolerances={"grad:*": 0.1}))
    tols = {"grad:*norm.weight": (0.0, 1e-4), "grad:*": (1e-3, 0.0)}
    assert tolerance("grad", "layers.0.ffn_norm.weight", None, None, tols) == (0.0, 1e-4)
    assert tolerance("grad", "lin.weight", None, None, tols) == (1e-3, 0.0)
    assert tolerance("param", "lin.weight", None, None, tols) == (None, None)
    assert tolerance("grad", "lin.weight", 0.5, 0.5, tols) == (0.5, 0.5)


class _Container(torch.optim.Optimizer):
    """Steps the optimizers it holds, as torchtitan's ``OptimizersContainer`` does (itself an ``Optimizer``)."""

    def __init__(self, params):
        self.optimizers = [torch.optim.SGD([p], lr=0.1) for p in params]
        super().__init__(params, {})

    def step(self, closure=None):
        for o in self.optimizers:
            o.step()


def test_own_steps_counted_by_the_outermost_optimizer_step():
    model = nn.Linear(2, 2)
    container = _Container(list(model.parameters()))
    sink = SimpleNamespace(step=None)
    with OptimizerSteps(sink) as own:
        assert sink.step == 1
        for _ in range(2):
            model(torch.ones(1, 2)).sum().backward()
            container.step()  # two inner steps inside it: one training step
    assert (own.finished, sink.step) == (2, 3)
    container.step()  # hooks removed: no longer counted
    assert own.finished == 2


def test_the_eager_reference_step_of_a_targets_check_step_is_not_one_of_its_steps():
    from dynamo_ext.audit import check_step

    spec = _trainer()
    sink = SimpleNamespace(step=None)
    with OptimizerSteps(sink) as own:
        check_step(spec)  # eager step, restore, compiled step: one training step of the target
    assert own.finished == 1 and sink.step == 2


def _stepped(event, step):
    return {**event, "step": step}


def test_report_per_step_per_rank_and_worst_and_json():
    def events(rank):
        body = [
            _stepped(comp(), 1),
            _stepped(comp(recompile="0/1: self.temperature == 1.0"), 2),
            _stepped(brk(), 2),
        ]
        if rank == 1:
            body.append(_stepped(comp(recompile="0/2: x.size()[0] == 4"), 3))
        return [{"ev": "start", "plugin": {"installed": True}}, *body, {"ev": "end", "counters": {}, "steps": 3}]

    report = merge({0: events(0), 1: events(1)}, target="t.py:make_step", world_size=2, backend="")
    per_rank = {r.rank: [(c.step, c.graph_breaks, c.graphs, c.recompiles) for c in r.steps] for r in report.ranks}
    assert per_rank == {0: [(1, 0, 1, 0), (2, 1, 1, 1), (3, 0, 0, 0)], 1: [(1, 0, 1, 0), (2, 1, 1, 1), (3, 0, 1, 1)]}
    assert [(c.step, c.graphs, c.recompiles) for c in report.steps] == [(1, 1, 0), (2, 1, 1), (3, 1, 1)]
    assert {r.reason.split(" ")[0]: r.steps for r in report.recompiles} == {
        "self.temperature": (2,),
        "x.size()[0]": (3,),
    }
    assert report.graph_breaks[0].steps == (2,)
    data = json.loads(json.dumps(report.to_json()))
    assert data["steps"][2] == {"step": 3, "graph_breaks": 0, "frame_skips": 0, "graphs": 1, "recompiles": 1}
    assert data["ranks"][0]["steps"][1]["recompiles"] == 1
    assert report_from_json(data).ranks[1].steps == report.ranks[1].steps
    text = str(report)
    assert "Per training step (worst rank)" in text and "  3 " in text


def test_no_step_stamps_no_per_step_report():
    report = merge({0: [{"ev": "start"}, comp(), {"ev": "end", "counters": {}}]}, target="t", world_size=1, backend="")
    assert report.steps == () and report.ranks[0].steps == ()
    assert "Per training step" not in str(report)


def test_graphs_of_later_steps_are_listed_and_left_out_of_the_counts():
    def comm_graph(cid, step, colls):
        return {"ev": "comm_graph", "compile_id": cid, "graph": "forward", "aot_id": 0, "inlined_aot_ids": [],
                "collectives": colls, "step": step}  # fmt: skip

    ar = _coll(0, "all_reduce", "all_reduce", origin="explicit", module="")
    events = [
        {"ev": "start"},
        {**comp(), "compile_id": "0/0", "step": 1},
        comm_graph("0/0", 1, [ar]),
        {**comp(recompile="0/1: lr == 0.1"), "compile_id": "0/1", "step": 2},
        comm_graph("0/1", 2, [ar, {**ar, "index": 1}]),
        {"ev": "end", "counters": {}, "steps": 3},
        {"ev": "numerics", "compared": 1, "mismatches": [], "eager_comm": {"forward": {"all_reduce": 1}}},
    ]
    comm = merge({0: events}, target="t", world_size=1, backend="").comm
    assert comm.counts == comm.eager_counts == (("forward", "all_reduce", 1),) and comm.count_differences == ()
    # the first step that compiled a graph is the one counted, whichever its number (a target's own loop)
    shifted = [{**e, "step": e["step"] + 1} if "step" in e and e["ev"] != "end" else e for e in events]
    later = merge({0: shifted}, target="t", world_size=1, backend="").comm
    assert later.counts == comm.counts and later.later_steps == (comm.later_steps[0].replace("step 2", "step 3"),)
    assert comm.bytes_per_step == 100
    assert [c.step for c in comm.collectives] == [1, 2, 2]
    assert comm.later_steps == ("step 2: forward graph train.py:8 step | recompile: lr == 0.1: all_reduce 2",)


# ---- eager counts: outside any module, outside the root (NOTE [collectives outside any module]) ----------------
class _Reducing(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x):
        import torch.distributed as dist
        import torch.distributed._functional_collectives as funcol

        return funcol.all_reduce(self.lin(x), "sum", dist.group.WORLD)


class _Root(nn.Module):
    def __init__(self):
        super().__init__()
        self.first = _Reducing()
        self.second = _Reducing()
        self.head = _Reducing()  # called by the loss, outside the root's forward (torchtitan's chunked loss)

    def forward(self, x):
        return self.second(self.first(x))


def test_eager_count_puts_collectives_after_backward_outside_any_module_and_names_modules_run_outside_the_root():
    import torch.distributed as dist
    import torch.distributed._functional_collectives as funcol

    from dynamo_ext.audit.rank.eager_comm import count_eager

    counts = {}
    with fake_world(4):
        root = _Root()
        with count_eager(counts):
            root.head(root(torch.randn(2, 4))).sum().backward()
            funcol.all_reduce(torch.ones(1), "sum", dist.group.WORLD)  # after backward: gradient clipping's norm
    modules = counts["modules"]
    assert modules["Global"]["forward"]["all_reduce"] == 4
    assert modules["first"]["forward"]["all_reduce"] == 1, modules["first"]  # not the clipping's all-reduce
    assert modules["<root>"]["forward"]["all_reduce"] == 2
    assert counts["outside_root"] == ["head", "head.lin"]


def test_count_units_of_a_module_run_outside_the_root_and_an_unexplained_difference_in_words():
    from dynamo_ext.audit.merge.comm_explain import explain_counts
    from dynamo_ext.audit.model.comm import Collective

    def coll(module, origin):
        return Collective(**{**{k: v for k, v in _coll(0, "all_reduce", "all_reduce").items() if k != "node"},
                             "shape_in": "[4]", "shape_out": "[4]", "group_ranks": (0, 2), "module": module,
                             "origin": origin, "graph": "g", "graph_kind": "forward", "phase": "forward",
                             "ranks": (0,), "sent_by_rank": ((0, 100),)})  # fmt: skip

    per = {"forward": {"all_reduce": 1}, "backward": {}}
    eager = {"Global": {"forward": {"all_reduce": 4}, "backward": {}}, "<root>": {"forward": {"all_reduce": 2}},
             "first": per, "second": per, "head": per}  # fmt: skip
    colls = [coll("first", "dtensor"), coll("second", "dtensor")]
    (d,) = explain_counts({("forward", "all_reduce"): 2}, {("forward", "all_reduce"): 4}, eager, colls, colls, [],
                          outside_root=frozenset({"head"}))  # fmt: skip
    # head's collective is in Global's count, not the root's: the root's own is 0, outside any module 1
    assert (
        d.reasons
        == (
            "head: compiled 0, eager 1: no compiled graph has a collective of it: ran eagerly",
            "outside any module: compiled 0, eager 1: no compiled graph has a collective of it: ran eagerly",
        )
        and d.unexplained == ""
    ), d
    (d,) = explain_counts({("forward", "all_reduce"): 2}, {("forward", "all_reduce"): 3},
                          {**eager, "Global": {"forward": {"all_reduce": 3}}, "second": {"forward": {"all_reduce": 0}},
                           "<root>": {"forward": {"all_reduce": 1}}},
                          colls, colls, [], outside_root=frozenset({"head"}))  # fmt: skip
    assert d.unexplained == (
        "second: compiled 1, eager 0 (compiled: 0 FSDP2's or explicit, 1 DTensor's; eager: 0 c10d, 0 functional)"
    ), d


# ---- module names by identity (NOTE [module names by identity]) -----------------------------------------------
class _Wo(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x):
        import torch.distributed as dist
        import torch.distributed._functional_collectives as funcol

        return funcol.all_reduce(self.lin(x), "sum", dist.group.WORLD)


class _Attention(nn.Module):
    def __init__(self):
        super().__init__()
        self.wo = _Wo()

    def forward(self, x):
        return self.wo(x)


class _Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.attention = _Attention()
        wrapped = self.attention.forward

        def forward_with_redistribution(*args):  # torchtitan 0.3.0's per-module forward wrapper
            return wrapped(*args)

        self.attention.forward = forward_with_redistribution

    def forward(self, x):
        return self.attention(x)


class _Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleDict({"0": _Block(), "1": _Block()})
        self.order = list(self.layers.values())  # a plain list: Dynamo reaches the blocks through it

    def forward(self, x):
        for block in self.order:
            x = block(x)
        return x


def test_resolve_follows_dynamos_paths_and_names_modules_by_identity():
    model = _Model()
    path = "L['self'].order[1].attention.forward.__closure__[0].cell_contents.__self__.wo"
    assert module_names.resolve(path, {"self": model}, {}) is model.layers["1"].attention.wo
    assert module_names.resolve("L['self'].layers.0", {"self": model}, {}) is model.layers["0"]
    names = module_names.fully_qualified_names([path, "L['self']", "L['self'].nothing", "G['x']"], {"self": model}, {})
    assert names == {path: "layers.1.attention.wo", "L['self']": "<root>"}
    with pytest.raises(LookupError, match=r"cannot follow"):
        module_names.resolve("L['self'].layers(0)", {"self": model}, {})
    assert module_names.without_closures("a.forward.__closure__[0].cell_contents.__self__.wo") == "a.wo"


def test_audit_names_a_module_reached_through_a_closure_and_a_list_by_its_fully_qualified_name(plugin):
    with fake_world(4):
        report = audit(_Model(), torch.randn(2, 8), backend="aot_eager")
    forward = [c.module for c in report.comm.collectives if c.graph_kind == "forward"]
    assert forward == ["layers.0.attention.wo", "layers.1.attention.wo"]


def test_script_function_target_is_read_without_running_its_main(tmp_path):
    from dynamo_ext.audit.rank.target import is_function_target, resolve_function, root_of_target, script_defines

    script = tmp_path / "train.py"
    script.write_text(
        textwrap.dedent("""
        import sys
        RAN = []
        def make_step():
            return "built"
        if __name__ == "__main__":
            sys.exit("main ran")
    """)
    )
    target = f"{script}:make_step"
    assert is_function_target(target) and resolve_function(target)() == "built"
    assert root_of_target(target) == str(tmp_path)
    assert script_defines(str(script), "make_step") is None
    assert (
        script_defines(str(script), "build")
        == f"script {str(script)!r} defines no 'build' at its top level (target {script}:build)"
    )
    assert not is_function_target(str(script))


# ---- on gloo ranks: dynamo-ext audit trains the step itself -----------------------------------------------------
@pytest.mark.gloo
def test_audit_trains_a_step_target_three_steps_reports_each_and_checks_them_from_one_build(tmp_path):
    from test_audit_e2e import TARGETS, cli, marker_line

    out = tmp_path / "steps.json"
    target = "tests/audit_targets/schedule_step.py:make_step"
    proc = cli("--nproc", "2", "--check-numerics", "--json", str(out), target)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    data = json.loads(out.read_text())
    assert [r["status"] for r in data["ranks"]] == ["ok", "ok"]
    # step 1 compiles, step 2 recompiles on the temperature the scheduler changed, step 3 reuses that graph
    assert [(s["step"], s["graphs"], s["recompiles"]) for s in data["steps"]] == [(1, 1, 0), (2, 1, 1), (3, 0, 0)]
    (recompile,) = data["recompiles"]
    assert recompile["steps"] == [2] and "self.temperature == 1.0" in recompile["reason"], recompile
    assert "Per training step (worst rank)" in proc.stdout
    # one build: make_step() refuses a second; three steps compared, each loss, 4 gradients and 4 parameters
    num = data["numerics"]
    assert (num["compared"], num["steps"], num["mismatches"], num["ranks"]) == (3 * 9, 3, [], [0, 1]), num
    assert "Numerics (3 compiled training steps vs eager, same state): 27 tensors per rank" in proc.stdout
    comm = data["comm"]
    assert comm["counts"] == comm["eager_counts"] == [["forward", "all_reduce", 1]], comm["counts"]
    assert [c["step"] for c in comm["collectives"]] == [1, 2]
    line = marker_line(TARGETS / "schedule_step.py", "def forward")
    assert comm["later_steps"] == [
        f"step 2: forward graph tests/audit_targets/schedule_step.py:{line} forward | recompile: self.temperature == "
        "1.0: all_reduce 1"
    ]


@pytest.mark.gloo
def test_a_script_whose_step_builds_once_is_told_to_name_its_make_step(tmp_path):
    """The script form runs ``main()`` (which builds the step), then builds ``make_step()`` again for the check:
    what torchtitan's trainer cannot do; the error says which TARGET builds it once."""
    from test_audit_e2e import cli

    target = "tests/audit_targets/schedule_step.py"
    proc = cli("--nproc", "2", "--quiet", "--check-numerics", target)
    assert proc.returncode == 2, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "numerics check: RuntimeError: building make_step() again after the target's run failed: " in proc.stderr
    assert (
        f"make_step() called twice in one process; this target builds once; to build it once, audit {target}:make_step"
        in proc.stderr
    )
