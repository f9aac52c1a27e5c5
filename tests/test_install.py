"""install() / uninstall(): nothing at import, idempotent, and every patch undone exactly."""

from __future__ import annotations

import subprocess
import sys

import torch
import torch._dynamo.guards
import torch._dynamo.output_graph as output_graph
import torch._dynamo.package
import torch._dynamo.variables.builder as builder
from helpers import CountingBackend, normalize_gm

import dynamo_ext
from dynamo_ext._patching import PATCHES


def _snapshot() -> dict[str, dict[str, object]]:
    """Snapshot of every namespace the plugin may patch: object identity, config values by value."""
    import torch._dynamo.compiled_autograd as compiled_autograd
    import torch._functorch._aot_autograd.frontend_utils as frontend_utils
    import torch._functorch.aot_autograd as aot_autograd
    import torch._inductor.codecache as codecache
    import torch._inductor.config as inductor_config
    import torch._inductor.lowering as lowering
    import torch.fx.experimental.proxy_tensor as proxy_tensor

    spaces = {
        "VariableBuilder": vars(builder.VariableBuilder),
        "SourcelessBuilder": vars(builder.SourcelessBuilder),
        "GuardBuilder": vars(torch._dynamo.guards.GuardBuilder),
        "SubgraphTracer": vars(output_graph.SubgraphTracer),
        "OutputGraph": vars(output_graph.OutputGraph),
        "CheckFunctionManager": vars(torch._dynamo.guards.CheckFunctionManager),
        "CompilePackage": vars(torch._dynamo.package.CompilePackage),
        "AutogradCompilerInstance": vars(compiled_autograd.AutogradCompilerInstance),
        "proxy_tensor": vars(proxy_tensor),
        "torch._dynamo.guards": vars(torch._dynamo.guards),
        "lowerings": lowering.lowerings,
        "aot_autograd": vars(aot_autograd),
        "frontend_utils": vars(frontend_utils),
        "FxGraphCachePickler": vars(codecache.FxGraphCachePickler),
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


# ---- install robustness --------------------------------------------------------------------
def test_enabled_blocks_in_threads_never_uninstall_under_each_other():
    import threading
    import time

    errors: list[BaseException] = []
    start = threading.Barrier(3)

    def worker() -> None:
        try:
            start.wait()
            for _ in range(30):
                with dynamo_ext.enabled():
                    time.sleep(0.002)  # let the other threads enter and leave their blocks meanwhile
                    assert dynamo_ext.is_installed()
                    assert builder.VariableBuilder._wrap is not stock_wrap  # the patch is in place in here
        except BaseException as e:  # noqa: BLE001  (reported by the main thread)
            errors.append(e)

    stock_wrap = builder.VariableBuilder._wrap
    threads = [threading.Thread(target=worker) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    assert not dynamo_ext.is_installed() and len(PATCHES) == 0
    assert builder.VariableBuilder._wrap is stock_wrap


def test_install_and_uninstall_wait_for_dynamos_compile_lock():
    import threading

    from dynamo_ext import _compat

    for action in (dynamo_ext.install, dynamo_ext.uninstall):
        with _compat.compile_lock():  # as while another thread compiles a frame
            n_patches, wrap = len(PATCHES), vars(builder.VariableBuilder)["_wrap"]
            t = threading.Thread(target=action)
            t.start()
            t.join(0.3)
            assert len(PATCHES) == n_patches and vars(builder.VariableBuilder)["_wrap"] is wrap, (
                f"{action.__name__}() patched while a frame was being compiled"
            )
        t.join()
    assert not dynamo_ext.is_installed() and len(PATCHES) == 0


def test_patcher_restores_class_attributes_as_class_attributes():
    from dynamo_ext._patching import Patcher

    class Base:
        def method(self):
            return "base"

        @staticmethod
        def static():
            return "static"

    class Sub(Base):
        pass

    obj = Sub()
    patches = Patcher()
    patches.setattr(Sub, "method", lambda self: "ours")  # inherited, not defined on Sub
    patches.setattr(obj, "static", lambda: "ours")  # found on the class, not on the instance
    patches.setattr(Base, "static", staticmethod(lambda: "ours too"))
    assert obj.method() == "ours" and obj.static() == "ours" and Sub.static() == "ours too"
    patches.undo_all()
    assert "method" not in vars(Sub) and "static" not in vars(obj)  # no copies left behind
    assert isinstance(vars(Base)["static"], staticmethod) and obj.static() == "static" and obj.method() == "base"


def test_uninstall_leaves_a_later_patch_of_the_same_attribute_alone():
    import logging

    class Records(logging.Handler):
        def __init__(self) -> None:
            super().__init__(logging.WARNING)
            self.messages: list[str] = []

        def emit(self, record: logging.LogRecord) -> None:
            self.messages.append(record.getMessage())

    stock = vars(builder.VariableBuilder)["_wrap"]
    dynamo_ext.install()
    ours = builder.VariableBuilder._wrap
    theirs = lambda self, value: ours(self, value)  # noqa: E731  (another library wrapping ours)
    builder.VariableBuilder._wrap = theirs
    records, logger = Records(), logging.getLogger("dynamo_ext._patching")
    logger.addHandler(records)
    try:
        dynamo_ext.uninstall()
        assert builder.VariableBuilder._wrap is theirs
        assert any("VariableBuilder._wrap was changed after install" in m for m in records.messages), records.messages
    finally:
        logger.removeHandler(records)
        builder.VariableBuilder._wrap = stock  # "they" undo theirs (to stock: they would restore ours)
    assert len(PATCHES) == 0


def test_user_post_grad_pass_set_after_install_is_chained_and_kept_on_uninstall():
    from dynamo_ext import _compat
    from dynamo_ext.inductor_lowerings.registry import _members

    calls: list[str] = []

    class UserPass(_compat.custom_graph_pass_base()):
        def __call__(self, graph):
            calls.append("user")

        def uuid(self):
            return b"user-pass-after-install"

    cfg = _compat.inductor_config()
    before = cfg.post_grad_custom_post_pass
    user = UserPass()
    with cfg.patch(fx_graph_cache=False):  # a cache hit would skip the passes
        dynamo_ext.install()
        ours = _members(cfg.post_grad_custom_post_pass)
        assert [type(p).__name__ for p in ours] == [
            "ResidualRMSNormPass",
            "AllReduceBucketingPass",
            "CommunicationOrderPass",
            "SubgraphOutputCopyPass",
        ]
        cfg.post_grad_custom_post_pass = user  # replaces the plugin's chain
        try:
            torch.compile(lambda x: x.sin() + 1, backend="inductor")(torch.randn(4))
            assert calls == ["user"]
            members = _members(cfg.post_grad_custom_post_pass)
            assert members[0] is user and members[1:] == ours  # theirs first, ours chained after
        finally:
            dynamo_ext.uninstall()
        assert cfg.post_grad_custom_post_pass is user  # the user's setting, without ours
        cfg.post_grad_custom_post_pass = before
