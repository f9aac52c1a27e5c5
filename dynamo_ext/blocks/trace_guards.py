"""A traced block's guards carried to an identical block: sources renamed, checked now, then installed.

NOTE [a block's guards carried over]
Dynamo's guards say what a trace read.  When block ``i`` of a container is
stamped from the trace of block ``0`` (NOTE [blocks traced once] in
``trace_once.py``), block ``i``'s trace would have read the same things
through its own objects: every guard of block ``0``'s trace whose source is
rooted at block ``0`` (``L['self'].layers[0]...``) is renamed to block ``i``
(``L['self'].layers[i]...``), checked now against block ``0``'s value under
the guard's own notion of "same" (:data:`_SAME`: a type, a constant, a
length, a dict's keys, an object's identity, a tensor's metadata, one of
the plugin's distributed-object records), and only if every one holds is the
block stamped and the renamed guards installed, so a later change to block
``i`` recompiles as if it had been traced.

Two things besides the source carry a block's identity:

- hook handles: module hook dicts are keyed by a global counter, so block
  ``i``'s ``_forward_hooks`` has other keys than block ``0``'s.  The keys of
  the two blocks' hook dicts are matched in order, module by module
  (:func:`hook_key_map`), and a guard's key on a hook-keyed dict
  (``DICT_NOT_CONTAINS`` on ``_forward_hooks_always_called``, a global one
  included) is renamed with them;
- aliasing: ``DUPLICATE_INPUT`` says two sources are one object; both are
  renamed and checked.

A guard of a kind not in :data:`_SAME`, with arguments we do not rename, or
whose source mentions block ``0`` in a way the renaming does not reach,
refuses the stamp (the block is traced, and why is logged).  Guards on
sources outside block ``0`` (globals, the root module) were already
installed by block ``0``'s trace and are the same for block ``i``.
"""

from __future__ import annotations

import dataclasses
import functools
import re
import types
from collections.abc import Callable
from typing import Any, cast

import torch

from .. import _compat

# nn.Module dicts keyed by hook handle ids (``RemovableHandle.id``), per module and global.
_HOOK_DICTS = (
    "_forward_hooks",
    "_forward_hooks_with_kwargs",
    "_forward_hooks_always_called",
    "_forward_pre_hooks",
    "_forward_pre_hooks_with_kwargs",
    "_backward_hooks",
    "_backward_pre_hooks",
    "_state_dict_hooks",
    "_state_dict_pre_hooks",
    "_load_state_dict_pre_hooks",
    "_load_state_dict_post_hooks",
)
_MODULE_HOOK_DICTS = tuple(d for d in _HOOK_DICTS if d not in ("_forward_hooks_with_kwargs",))
_GLOBAL_HOOK_DICTS = tuple("_global" + d for d in _HOOK_DICTS)


class StampError(Exception):
    """Why a block cannot be stamped from a recording (a sentence for the log)."""


@dataclasses.dataclass
class Renaming:
    """Block ``0``'s source and names, and block ``i``'s, with the hook keys matched between them."""

    old: Any
    new: Any
    old_name: str
    new_name: str
    old_path: str
    new_path: str
    hook_keys: dict[int, int]
    _memo: dict[Any, Any] = dataclasses.field(default_factory=dict)
    _mapping: dict[Any, Any] = dataclasses.field(default_factory=dict)

    def __post_init__(self) -> None:
        old, new = block_sources(self.old), block_sources(self.new)
        if len(old) != len(new):
            raise StampError("it is reached through other module wrappers than the recorded block")
        self._mapping = dict(zip(old, new))

    def source(self, source: Any) -> Any:
        """``source`` with block ``0``'s source replaced by block ``i``'s wherever it occurs."""
        return _rename_source(source, self._mapping, self._memo)

    def text(self, text: str) -> str:
        """A source name, or a module path as Dynamo spells it in ``nn_module_stack``, renamed
        (``L['m']._modules['layers']._modules['0']`` and ``L['m'].layers.0`` to block ``i``'s)."""
        return _rename_text(_rename_text(text, self.old_name, self.new_name), self.old_path, self.new_path)


def block_sources(source: Any) -> list[Any]:
    """A block's source and the ones it wraps (Dynamo marks a module's source as one: ``NNModuleSource``)."""
    out = [source]
    while _compat.source_kind(source) == "module":
        source = source.base
        out.append(source)
    return out


def _rename_source(source: Any, mapping: dict[Any, Any], memo: dict[Any, Any] | None = None) -> Any:
    if memo is not None and source in memo:
        return memo[source]
    if source in mapping:
        out = mapping[source]
    elif not dataclasses.is_dataclass(source):
        out = source
    else:
        changes = {}
        for name in _field_names(type(source)):
            value = getattr(source, name, None)
            if isinstance(value, _compat.Source):
                renamed = _rename_source(value, mapping, memo)
                if renamed is not value:
                    changes[name] = renamed
        out = dataclasses.replace(cast(Any, source), **changes) if changes else source
    if memo is not None:
        memo[source] = out
    return out


@functools.cache
def _field_names(cls: type) -> tuple[str, ...]:
    """A source dataclass's field names (``dataclasses.fields`` builds its tuple anew on every call)."""
    return tuple(f.name for f in dataclasses.fields(cls))


def replace_source(source: Any, old: Any, new: Any, memo: dict[Any, Any] | None = None) -> Any:
    """``source`` with ``old`` replaced by ``new`` wherever it occurs (an index's source included)."""
    return _rename_source(source, {old: new}, memo)


@functools.lru_cache(maxsize=4096)
def _name_pattern(name: str) -> re.Pattern[str]:
    # The name followed by the end of a path step, so layers[1] does not match inside layers[10].
    return re.compile(re.escape(name) + r"(?=[.\[\)\]]|$)")


def _rename_text(text: str, old: str, new: str) -> str:
    return _name_pattern(old).sub(lambda _: new, text)


def mentions(text: str, name: str) -> bool:
    """Whether the source name or module path ``text`` goes through ``name``."""
    return _name_pattern(name).search(text) is not None


def hook_key_map(old_block: torch.nn.Module, new_block: torch.nn.Module) -> dict[int, int]:
    """Block ``0``'s hook handle ids to block ``i``'s, matched in order module by module.

    Raises:
        StampError: the two blocks' modules, or the number of hooks on a module, differ.
    """
    old_modules = list(old_block.named_modules(remove_duplicate=False))
    new_modules = list(new_block.named_modules(remove_duplicate=False))
    if [(n, type(m)) for n, m in old_modules] != [(n, type(m)) for n, m in new_modules]:
        raise StampError("its submodules differ from the recorded block's")
    keys: dict[int, int] = {}
    for (name, a), (_, b) in zip(old_modules, new_modules):
        for attr in _MODULE_HOOK_DICTS:
            old_keys, new_keys = list(getattr(a, attr, {})), list(getattr(b, attr, {}))
            if len(old_keys) != len(new_keys):
                raise StampError(
                    f"module {name or '(block)'} has {len(new_keys)} {attr}, the recorded block {len(old_keys)}"
                )
            keys.update((k, v) for k, v in zip(old_keys, new_keys) if isinstance(k, int))
    return keys


def _hook_keyed(source: Any) -> bool:
    while _compat.source_kind(source) == "module":
        source = source.base
    member = getattr(source, "member", None)
    return member in _HOOK_DICTS or member in _GLOBAL_HOOK_DICTS


@dataclasses.dataclass(frozen=True)
class GuardPlan:
    """One recorded guard: its kind, source and arguments, and block ``0``'s value as the kind compares it."""

    guard: Any
    kind: str
    rooted: bool
    recorded: Any


def _tensor_meta(t: Any) -> Any:
    if not isinstance(t, torch.Tensor):
        return ("not a tensor", type(t))
    return (
        type(t),
        tuple(t.shape),
        tuple(t.stride()),
        t.storage_offset(),
        t.dtype,
        t.device,
        t.requires_grad,
        t.layout,
    )


def _code_or_identity(v: Any) -> Any:
    return ("code", v.__code__) if type(v) is types.FunctionType else ("id", id(v))


def _keys(v: Any) -> Any:
    return (type(v), list(dict.keys(v))) if isinstance(v, dict) else ("not a dict", type(v))


def _length(v: Any) -> Any:
    try:
        return (type(v), len(v))
    except TypeError:
        return ("no length", type(v))


# kind -> what block 0's value is recorded as (from the value and the guard's keyword arguments).  Block i's
# value is recorded the same way (its keys and names renamed first) and the two compared with ==.
_SAME: dict[str, Callable[[Any, dict[str, Any]], Any]] = {
    "TYPE_MATCH": lambda v, kw: type(v),
    "ID_MATCH": lambda v, kw: id(v),
    "CLASS_MATCH": lambda v, kw: id(v),
    "BUILTIN_MATCH": lambda v, kw: id(v),
    "MODULE_MATCH": lambda v, kw: id(v),
    "FUNCTION_MATCH": lambda v, kw: id(v),
    "NONE_MATCH": lambda v, kw: v is None,
    "BOOL_MATCH": lambda v, kw: (type(v), v),
    "CONSTANT_MATCH": lambda v, kw: (type(v), v),
    "EQUALS_MATCH": lambda v, kw: (type(v), v),
    "CLOSURE_MATCH": lambda v, kw: _code_or_identity(v),
    "SEQUENCE_LENGTH": lambda v, kw: _length(v),
    "EMPTY_NN_MODULE_HOOKS_DICT": lambda v, kw: _length(v),
    "DICT_KEYS_MATCH": lambda v, kw: _keys(v),
    "DICT_CONTAINS": lambda v, kw: kw["key"] in v,
    "DICT_NOT_CONTAINS": lambda v, kw: kw["key"] not in v,
    "HASATTR": lambda v, kw: hasattr(v, kw["attr"]),
    "NOT_PRESENT_IN_GENERIC_DICT": lambda v, kw: kw["attr"] in getattr(v, "__dict__", {}),
    "DTENSOR_SPEC_MATCH": lambda v, kw: getattr(v, "_spec", v),
    "TENSOR_MATCH": lambda v, kw: _tensor_meta(v),
    "OPAQUE_OBJ_GUARD_FN_MATCH": lambda v, kw: _compat.opaque_guard_values(v),
    "FAKE_SCRIPT_TYPE_MATCH": lambda v, kw: _compat.script_object_type(v),
}
# Installed by Dynamo's VariableBuilder for each graph input the stamp lifts: not installed again.
_INSTALLED_WITH_INPUTS = frozenset({"TENSOR_MATCH"})


def _kind(guard: Any) -> str:
    fn = guard.create_fn
    return getattr(fn.func if isinstance(fn, functools.partial) else fn, "__name__", "?")


def _spec_of(guard: Any) -> Any:
    fn = guard.create_fn
    return getattr(fn.func if isinstance(fn, functools.partial) else fn, "guard_spec", None)


def _keywords(guard: Any) -> dict[str, Any]:
    fn = guard.create_fn
    return dict(fn.keywords) if isinstance(fn, functools.partial) else {}


def plan(guards: list[Any], old: list[Any], old_name: str, resolve: Callable[[Any], Any]) -> list[GuardPlan]:
    """The plans of the guards of block ``0``'s trace that block ``i`` needs renamed; raises :class:`StampError`.

    Args:
        guards: Dynamo ``Guard`` objects of the recorded trace (its new guards and earlier ones on block ``0``).
        old: block ``0``'s sources (:func:`block_sources`); ``old_name`` its name.
        resolve: a source's value now (``Source.get_value`` on the frame's globals and locals).
    """
    plans = []
    seen: set[tuple[Any, ...]] = set()
    for guard in guards:
        source = guard.originating_source
        kind, keywords = _kind(guard), _keywords(guard)
        cls = _class_of(source)
        if cls is not None and _rooted(cls, old):
            # A class attribute Dynamo looked up through the MRO: it reuses the first source it found for the
            # same attribute of the same class (``OutputGraph.mro_source_cache``), so block i's trace guards
            # block 0's path.  Carried as a check that block i's object has that class, not installed.
            key = ("class", cls)
            if key not in seen:
                seen.add(key)
                plans.append(GuardPlan(guard, _CLASS, True, id(_read(resolve, cls))))
            continue
        rooted = source is not None and _rooted(source, old)
        hook_key = "key" in keywords and _hook_keyed(source)
        dupe = keywords.get("source_b")
        if dupe is not None and _rooted(dupe, old):
            rooted = True
        if not rooted and not hook_key:
            if source is not None and mentions(_compat.source_name(source), old_name):
                raise StampError(
                    f"guard {kind} on {_compat.source_name(source)} reaches the block by a path we do not rename"
                )
            continue
        key = (kind, source, tuple(sorted((k, repr(v)) for k, v in keywords.items())))
        if key in seen:
            continue
        seen.add(key)
        spec = _spec_of(guard)
        if spec is None and kind not in _SAME and kind != "DUPLICATE_INPUT":
            raise StampError(
                f"its trace installed a {kind} guard on {_compat.source_name(source)}, a kind not carried over"
            )
        unknown = set(keywords) - {"key", "attr", "source_b", "value", "recompile_hint"}  # the hint: a message
        if unknown:
            raise StampError(f"its {kind} guard has arguments {sorted(unknown)}, not carried over")
        try:
            if kind == "DUPLICATE_INPUT":
                recorded = resolve(source) is resolve(dupe)
            else:
                value = resolve(source)
                recorded = spec.extract(value) if spec is not None else _SAME[kind](value, keywords)
        except Exception as e:  # a value read in a way Dynamo's guard reads it and we do not
            raise StampError(f"its {kind} guard on {_compat.source_name(source)} cannot be read ({e!r})") from None
        plans.append(GuardPlan(guard, kind, rooted, recorded))
    return plans


def _read(resolve: Callable[[Any], Any], source: Any) -> Any:
    """``resolve(source)``; :class:`StampError` where the source cannot be read (a path one block lacks)."""
    try:
        return resolve(source)
    except Exception as e:
        raise StampError(f"{_compat.source_name(source)} cannot be read ({type(e).__name__}: {e})") from None


_CLASS = "class of a looked-up attribute"


def _class_of(source: Any) -> Any:
    """The ``TypeSource`` a source reads a class attribute through (``type(x).__mro__[i].__dict__[name]``)."""
    s, through_class = source, False
    while s is not None:
        if _compat.source_kind(s) == "class dict":
            through_class = True
        elif through_class and _compat.source_kind(s) == "type":
            return s
        s = getattr(s, "base", None)
    return None


def _rooted(source: Any, old: list[Any]) -> bool:
    return _rename_source(source, dict.fromkeys(old, _SENTINEL)) is not source


class _Sentinel:
    pass


_SENTINEL = _Sentinel()


def carry(
    plans: list[GuardPlan], renaming: Renaming, resolve: Callable[[Any], Any], path: Callable[[Any], Any]
) -> list[Any]:
    """Block ``i``'s guards for ``plans``, each checked against block ``0``'s value; raises :class:`StampError`.

    ``path(source)`` is the source a trace reaches the renamed source's object by (an object the frame already
    tracks is reached by its tracker's source): the guard goes there.  Returns the renamed Dynamo ``Guard``
    objects to install (none is installed here).
    """
    out = []
    for p in plans:
        guard = p.guard
        if p.kind == _CLASS:
            cls = _class_of(guard.originating_source)
            if id(_read(resolve, renaming.source(cls))) != p.recorded:
                raise StampError(
                    f"{_compat.source_name(renaming.source(cls))} is another class than the recorded block's"
                )
            continue
        keywords = _keywords(guard)
        source = path(renaming.source(guard.originating_source))
        if "key" in keywords and _hook_keyed(guard.originating_source):
            keywords["key"] = renaming.hook_keys.get(keywords["key"], keywords["key"])
        if "source_b" in keywords:
            keywords["source_b"] = path(renaming.source(keywords["source_b"]))
            if keywords["source_b"] == source:
                continue  # both names reach the object by one path now: nothing to guard
        try:
            if p.kind == "DUPLICATE_INPUT":
                now = resolve(source) is resolve(keywords["source_b"])
            else:
                value = resolve(source)
                spec = _spec_of(guard)
                if spec is not None:
                    now = spec.extract(value)
                elif p.kind == "DICT_KEYS_MATCH" and _hook_keyed(guard.originating_source):
                    now = _keys(value)
                    recorded = p.recorded
                    if recorded[0] is not now[0] or [renaming.hook_keys.get(k, k) for k in recorded[1]] != now[1]:
                        raise StampError(f"{_compat.source_name(source)} has other keys than the recorded block's")
                    now = p.recorded
                else:
                    now = _SAME[p.kind](value, keywords)
            same = bool(now == p.recorded)
        except StampError:
            raise
        except Exception as e:  # a source block i does not have, a value that does not compare
            raise StampError(f"{_compat.source_name(source)} cannot be read ({type(e).__name__}: {e})") from None
        if not same:
            raise StampError(f"guard {p.kind} on {_compat.source_name(source)} differs from the recorded block's")
        if p.kind in _INSTALLED_WITH_INPUTS:
            continue
        fn = guard.create_fn
        if isinstance(fn, functools.partial):
            fn = functools.partial(fn.func, *fn.args, **keywords)
        out.append(_compat.renamed_guard(guard, source, fn))
    return out
