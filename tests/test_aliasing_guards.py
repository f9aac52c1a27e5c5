"""NOTE [object-aliasing guards in C++]: while the plugin compiles, Dynamo's aliasing guards are relational guards;
they still hold (an argument that stops aliasing another recompiles), and the user's switch is back afterwards."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from helpers import CountingBackend

import dynamo_ext
from dynamo_ext import _compat
from dynamo_ext._patching import Patcher

_SWITCH = "use_lamba_guard_for_object_aliasing"


class _Holder:
    def __init__(self, scale: float) -> None:
        self.w = torch.full((3,), scale)


def _f(a: _Holder, b: _Holder, x: torch.Tensor) -> torch.Tensor:
    return x * a.w + b.w


@pytest.fixture
def plugin():
    dynamo_ext.install()
    try:
        yield
    finally:
        dynamo_ext.uninstall()


@pytest.mark.parametrize("in_cpp", [True, False], ids=["relational", "lambda"])
def test_aliasing_guard_holds_and_switch_is_scoped_to_the_compile(plugin, in_cpp: bool):
    seen: list[bool] = []
    lambdas: list[list[str]] = []
    builder = _compat.GuardBuilder
    original_lambda = builder.add_python_lambda_leaf_guard_to_root

    def spy(self: Any, code_parts: list[str], *args: Any, **kwargs: Any) -> Any:
        lambdas.append(list(code_parts))
        return original_lambda(self, code_parts, *args, **kwargs)

    counting = CountingBackend()

    def backend(gm: torch.fx.GraphModule, example_inputs: Any) -> Any:
        seen.append(getattr(torch._dynamo.config, _SWITCH))
        return counting(gm, example_inputs)

    patches = Patcher()
    patches.setattr(builder, "add_python_lambda_leaf_guard_to_root", spy)
    try:
        # The user's value True (2.13's default; 2.15's is False, where the plugin has nothing to switch off).
        with torch._dynamo.config.patch(**{_SWITCH: True}), dynamo_ext.config.patch(aliasing_guards_in_cpp=in_cpp):
            fn = torch.compile(_f, backend=backend)
            one, other, x = _Holder(1.0), _Holder(1.0), torch.ones(3)
            torch.testing.assert_close(fn(one, one, x), _f(one, one, x))
            torch.testing.assert_close(fn(one, one, x), _f(one, one, x))
            assert counting.frame_count == 1
            torch.testing.assert_close(fn(one, other, x), _f(one, other, x))  # no longer aliased: recompiles
            assert counting.frame_count == 2
            assert getattr(torch._dynamo.config, _SWITCH) is True  # the user's value once compiled
    finally:
        patches.undo_all()
        torch._dynamo.reset()
    assert seen == [not in_cpp] * 2
    aliasing_lambdas = [parts for parts in lambdas if any(" is " in p for p in parts)]
    assert bool(aliasing_lambdas) == (not in_cpp), lambdas


def test_users_own_switch_is_left_alone(plugin):
    seen: list[bool] = []

    def backend(gm: torch.fx.GraphModule, example_inputs: Any) -> Any:
        seen.append(getattr(torch._dynamo.config, _SWITCH))
        return gm.forward

    try:
        with torch._dynamo.config.patch(**{_SWITCH: False}):
            one = _Holder(1.0)
            torch.compile(_f, backend=backend)(one, one, torch.ones(3))
    finally:
        torch._dynamo.reset()
    assert seen == [False]
