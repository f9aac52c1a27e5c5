"""install() / uninstall(): nothing at import, idempotent, and every patch undone exactly."""

from __future__ import annotations

import subprocess
import sys

import torch
import torch._dynamo.guards
import torch._dynamo.variables.builder as builder
from helpers import CountingBackend, normalize_gm

import dynamo_ext
from dynamo_ext._patching import PATCHES


def _snapshot() -> dict[str, dict[str, object]]:
    """Snapshot of every namespace the plugin may patch: object identity, config values by value."""
    import torch._inductor.config as inductor_config
    import torch._inductor.lowering as lowering

    spaces = {
        "VariableBuilder": vars(builder.VariableBuilder),
        "SourcelessBuilder": vars(builder.SourcelessBuilder),
        "GuardBuilder": vars(torch._dynamo.guards.GuardBuilder),
        "torch._dynamo.guards": vars(torch._dynamo.guards),
        "lowerings": lowering.lowerings,
    }
    snap = {name: {k: id(v) for k, v in dict(ns).items()} for name, ns in spaces.items()}
    for name, cfg in (("inductor.config", inductor_config), ("dynamo.config", torch._dynamo.config)):
        snap[name] = {k: repr(v) for k, v in cfg.get_config_copy().items()}
    return snap


def test_import_changes_nothing():
    code = (
        "import torch._dynamo.variables.builder as b; before = b.VariableBuilder._wrap; "
        "import dynamo_ext; assert b.VariableBuilder._wrap is before; assert not dynamo_ext.is_installed()"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_uninstall_restores_everything_exactly():
    before = _snapshot()
    dynamo_ext.install()
    assert dynamo_ext.is_installed() and len(PATCHES) > 0
    assert _snapshot() != before
    dynamo_ext.uninstall()
    assert not dynamo_ext.is_installed() and len(PATCHES) == 0
    after = _snapshot()
    for name in before:
        changed = {k for k in before[name].keys() | after[name].keys() if before[name].get(k) != after[name].get(k)}
        assert not changed, f"{name}: not restored: {sorted(changed)}"


def test_install_twice_is_a_no_op_and_enabled_nests():
    with dynamo_ext.enabled():
        n = len(PATCHES)
        dynamo_ext.install()
        assert len(PATCHES) == n
        with dynamo_ext.enabled():
            assert dynamo_ext.is_installed()
        assert dynamo_ext.is_installed()  # the inner block did not uninstall what it did not install
    assert not dynamo_ext.is_installed()


def _graph_text(fn, *args) -> str:
    torch._dynamo.reset()
    backend = CountingBackend()
    torch.compile(fn, backend=backend)(*args)
    return "\n".join(normalize_gm(g.print_readable(False)) for g in backend.graphs)


def test_code_without_distributed_objects_traces_as_stock():
    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(4, 4)

        def forward(self, x, scale: float):
            y = self.lin(x).relu() * scale
            if y.sum() > 0:  # a data-dependent branch: a graph break in both
                y = y + 1
            return y, {"k": y.shape[0]}

    torch.manual_seed(0)
    net, x = Net(), torch.randn(3, 4)
    stock = _graph_text(net, x, 2.0)
    with dynamo_ext.enabled():
        ours = _graph_text(net, x, 2.0)
    assert ours == stock
