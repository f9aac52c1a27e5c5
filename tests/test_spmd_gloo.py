"""dynamo_ext.spmd on 4 gloo ranks: local shards against torch_xla's documented layout, compiled vs eager.

The mesh is ``Mesh(range(4), (2, 2), ("x", "y"))``: rank ``r`` sits at mesh
coordinate ``(r // 2, r % 2)``.  torch_xla's ``mark_sharding`` docs: spec entry
``i`` names the mesh axis (by name or index) that shards tensor dim ``i``,
``None`` keeps the dim whole, a tuple shards the dim over several axes with
the first one major, and each device holds the tile of its coordinate (tiles
of ``ceil(size / n)``, the last ones short or empty when uneven).

One launch of 4 ranks serves both tests (the ``ranks`` fixture).
"""

from __future__ import annotations

import pytest
import torch
from helpers import run_parts_on_ranks

pytestmark = pytest.mark.gloo

ALL = slice(None)
# (shape, spec, {rank: (rows, cols)}) written from the docs for the (2, 2) mesh above.
TABLE = [
    ((8, 4), ("x", None), {0: (slice(0, 4), ALL), 1: (slice(0, 4), ALL), 2: (slice(4, 8), ALL), 3: (slice(4, 8), ALL)}),
    ((8, 4), (None, "y"), {0: (ALL, slice(0, 2)), 1: (ALL, slice(2, 4)), 2: (ALL, slice(0, 2)), 3: (ALL, slice(2, 4))}),
    (
        (8, 4),
        (0, 1),
        {
            0: (slice(0, 4), slice(0, 2)),
            1: (slice(0, 4), slice(2, 4)),
            2: (slice(4, 8), slice(0, 2)),
            3: (slice(4, 8), slice(2, 4)),
        },
    ),
    (
        (8, 4),
        ("y", "x"),
        {
            0: (slice(0, 4), slice(0, 2)),
            1: (slice(4, 8), slice(0, 2)),
            2: (slice(0, 4), slice(2, 4)),
            3: (slice(4, 8), slice(2, 4)),
        },
    ),
    ((8, 4), (None, None), {r: (ALL, ALL) for r in range(4)}),
    # one dim over both axes, "x" major: tile = 2 * x + y
    ((8, 4), (("x", "y"), None), {r: (slice(2 * r, 2 * r + 2), ALL) for r in range(4)}),
    # "y" major: tile = 2 * y + x, so ranks 1 and 2 swap tiles
    (
        (8, 4),
        (("y", "x"), None),
        {0: (slice(0, 2), ALL), 1: (slice(4, 6), ALL), 2: (slice(2, 4), ALL), 3: (slice(6, 8), ALL)},
    ),
    (
        (4, 8),
        (None, (1, 0)),
        {0: (ALL, slice(0, 2)), 1: (ALL, slice(4, 6)), 2: (ALL, slice(2, 4)), 3: (ALL, slice(6, 8))},
    ),
    # uneven: 7 rows in tiles of 4 then 3; 5 columns in tiles of 3 then 2
    (
        (7, 5),
        ("x", "y"),
        {
            0: (slice(0, 4), slice(0, 3)),
            1: (slice(0, 4), slice(3, 5)),
            2: (slice(4, 7), slice(0, 3)),
            3: (slice(4, 7), slice(3, 5)),
        },
    ),
    # uneven over both axes: tiles of ceil(7 / 4) = 2, the last one short
    (
        (7, 2),
        (("x", "y"), None),
        {0: (slice(0, 2), ALL), 1: (slice(2, 4), ALL), 2: (slice(4, 6), ALL), 3: (slice(6, 7), ALL)},
    ),
    (
        (7, 2),
        (("y", "x"), None),
        {0: (slice(0, 2), ALL), 1: (slice(4, 6), ALL), 2: (slice(2, 4), ALL), 3: (slice(6, 7), ALL)},
    ),
    # 3 rows over 4 devices: the last tile is empty
    (
        (3, 2),
        (("x", "y"), None),
        {0: (slice(0, 1), ALL), 1: (slice(1, 2), ALL), 2: (slice(2, 3), ALL), 3: (slice(3, 3), ALL)},
    ),
]


def _reference_tile(t, mesh_shape, coord, axes_per_dim):
    """The tile of ``t`` at mesh coordinate ``coord``, computed from the docs' rule by hand."""
    index = []
    for dim, axes in enumerate(axes_per_dim):
        n, tile = 1, 0
        for axis in axes:
            tile = tile * mesh_shape[axis] + coord[axis]
            n *= mesh_shape[axis]
        step = -(-t.shape[dim] // n)
        start = min(tile * step, t.shape[dim])
        index.append(slice(start, min(start + step, t.shape[dim])))
    return t[tuple(index)]


def _axes(mesh, spec):
    out = []
    for entry in spec:
        entry = () if entry is None else entry if isinstance(entry, tuple) else (entry,)
        out.append(tuple(mesh.get_axis_name_idx(a) if isinstance(a, str) else a for a in entry))
    return out


def _shards(rank: int, world: int) -> dict:
    from helpers import CountingBackend

    from dynamo_ext.spmd import (
        Mesh,
        clear_sharding,
        disable_manual_sharding,
        enable_manual_sharding,
        get_sharding,
        mark_sharding,
        with_sharding_constraint,
    )

    mesh = Mesh(range(4), (2, 2), ("x", "y"))
    out: dict = {"table": [], "sweep": [], "rejected": []}

    # 1. the table, eager and compiled (one graph for all specs, no recompile for new data)
    inputs = [torch.arange(float(s[0] * s[1])).reshape(s) for s, _, _ in TABLE]

    def shard_all(*ts):
        return tuple(mark_sharding(t, mesh, spec).to_local() for t, (_, spec, _) in zip(ts, TABLE))

    backend = CountingBackend()
    compiled = torch.compile(shard_all, backend=backend, fullgraph=True)
    eager, first, second = shard_all(*inputs), compiled(*inputs), compiled(*[t + 1 for t in inputs])
    for i, (t, (_, spec, expected)) in enumerate(zip(inputs, TABLE)):
        want = t[expected[rank]]
        out["table"].append(
            (spec, torch.equal(eager[i], want), torch.equal(first[i], want), torch.equal(second[i], want + 1))
        )
    out["table_frames"] = backend.frame_count

    # 2. a sweep against the hand-computed tile; every rejected spec is one DTensor cannot lay out like torch_xla
    specs = [
        ("x", "y"),
        ("y", None),
        (None, 1),
        (("x", "y"), None),
        (("y", "x"), None),
        (None, ("x", "y")),
        (None, ("y", "x")),
    ]
    for shape in [(4, 4), (5, 3), (7, 6), (6, 5), (1, 5), (2, 9)]:
        t = torch.randn(shape, generator=torch.Generator().manual_seed(0))
        for spec in specs:
            try:
                d = mark_sharding(t, mesh, spec)
            except ValueError as e:
                out["rejected"].append((shape, spec, "layouts differ" in str(e)))
                continue
            tile = _reference_tile(t, (2, 2), mesh.get_coordinate(), _axes(mesh, spec))
            out["sweep"].append(
                (shape, spec, torch.equal(d.to_local(), tile), torch.equal(clear_sharding(d), t), get_sharding(d))
            )

    # 3. with_sharding_constraint on real collectives, compiled: placements change, no recompile
    backend = CountingBackend()

    @torch.compile(backend=backend, fullgraph=True)
    def constrain(t):
        d = mark_sharding(t, mesh, (("y", "x"), None))
        e = with_sharding_constraint(d, mesh, ("x", "y"))  # an all-to-all-like move over both axes
        f = with_sharding_constraint(e, mesh, ("x", "y"))  # already laid out so: no op
        return e, f.full_tensor()

    t = torch.arange(32.0).reshape(8, 4)
    results = [constrain(t), constrain(t * 3)]
    out["constrain"] = [
        (
            tuple(map(str, e.placements)),
            torch.equal(e.to_local(), _reference_tile(x, (2, 2), mesh.get_coordinate(), [(0,), (1,)])),
            torch.equal(full, x),
        )
        for (e, full), x in zip(results, [t, t * 3])
    ]
    out["constrain_frames"] = backend.frame_count

    # 4. manual sharding: work on this rank's tile by hand, then back to the global view
    def manual(t):
        local = enable_manual_sharding(t, ("y", "x"), mesh=mesh)
        return local, disable_manual_sharding(local * 2, ("y", "x"), t.shape, mesh=mesh).full_tensor()

    backend = CountingBackend()
    t = torch.arange(35.0).reshape(7, 5)  # uneven both ways
    tile = _reference_tile(t, (2, 2), mesh.get_coordinate(), [(1,), (0,)])
    out["manual"] = [
        (torch.equal(local, tile), torch.equal(full, t * 2))
        for local, full in (manual(t), torch.compile(manual, backend=backend, fullgraph=True)(t))
    ]
    out["manual_frames"] = backend.frame_count
    return out


def test_local_shards_match_torch_xla_layout_eager_and_compiled(ranks):
    results = ranks["shards"]
    for rank, r in enumerate(results):
        for spec, eager, first, second in r["table"]:
            assert (eager, first, second) == (True, True, True), (rank, spec)
        assert r["table_frames"] == 1
        assert len(r["sweep"]) >= 25
        for shape, spec, tile_ok, full_ok, back in r["sweep"]:
            assert tile_ok and full_ok, (rank, shape, spec)
            assert back == tuple({0: "x", 1: "y"}.get(e, e) for e in spec), (shape, spec, back)
        # uneven sizes over two axes that DTensor lays out differently are refused, with the reason
        assert all(ok for _, _, ok in r["rejected"])
        assert ((5, 3), (("x", "y"), None), True) in r["rejected"]
        assert r["constrain"] == [(("S(0)", "S(1)"), True, True)] * 2
        assert r["constrain_frames"] == 1
        assert r["manual"] == [(True, True)] * 2 and r["manual_frames"] == 1
    assert len({str(r["rejected"]) for r in results}) == 1  # every rank refuses the same specs


def _train(rank: int, world: int) -> dict:
    """Loss, gradients and parameters after 3 SGD steps: compiled vs eager vs one plain device."""
    import torch.nn.functional as F

    from dynamo_ext.spmd import Mesh, clear_sharding, mark_sharding, with_sharding_constraint

    mesh = Mesh(range(4), (2, 2), ("dp", "tp"))
    g = torch.Generator().manual_seed(0)  # the same global values on every rank
    w1_init, w2_init = torch.randn(6, 8, generator=g), torch.randn(8, 3, generator=g)
    batches = [torch.randn(8, 6, generator=g) for _ in range(3)]

    def sharded_loss(x, w1, w2):
        h = F.relu(mark_sharding(x, mesh, ("dp", None)) @ mark_sharding(w1, mesh, (None, "tp")))
        y = h @ mark_sharding(w2, mesh, ("tp", None))  # Partial over tp
        y = with_sharding_constraint(y, mesh, ("dp", None))  # the all-reduce over tp
        return clear_sharding(y).pow(2).mean()

    def plain_loss(x, w1, w2):
        return (F.relu(x @ w1) @ w2).pow(2).mean()

    def run(loss_fn, sharded_params=False):
        w1, w2 = w1_init.clone(), w2_init.clone()
        if sharded_params:  # torch_xla's pattern: shard the parameters themselves (DTensor leaves)
            w1, w2 = mark_sharding(w1, mesh, (None, "tp")), mark_sharding(w2, mesh, ("tp", None))
        w1, w2 = torch.nn.Parameter(w1), torch.nn.Parameter(w2)
        opt = torch.optim.SGD([w1, w2], lr=0.1)
        losses, grads = [], []
        for x in batches:
            opt.zero_grad()
            loss = loss_fn(x, w1, w2)
            loss.backward()
            losses.append(loss.detach())
            grads.append((type(w1.grad).__name__, clear_sharding(w1.grad), clear_sharding(w2.grad)))
            opt.step()
        kept = (tuple(map(str, w1.placements)), tuple(map(str, w2.placements))) if sharded_params else None
        return losses, grads, (clear_sharding(w1.detach()), clear_sharding(w2.detach())), kept

    frames = []

    def backend(gm, inputs):
        frames.append(gm)
        return torch._dynamo.backends.debugging.aot_eager(gm, inputs)

    reference = run(plain_loss)
    compiled_loss = torch.compile(sharded_loss, backend=backend, fullgraph=True)
    runs = {
        "eager": run(sharded_loss),
        "compiled": run(compiled_loss),
        "eager_sharded_params": run(sharded_loss, sharded_params=True),
        "compiled_sharded_params": run(compiled_loss, sharded_params=True),
    }

    def close(a, b):
        la, ga, pa, _ = a
        lb, gb, pb, _ = b
        return {
            "loss": all(torch.allclose(x, y, atol=1e-5) for x, y in zip(la, lb)),
            "grad_types": sorted({g[0] for g in ga}),
            "grads": all(
                torch.allclose(x[1], y[1], atol=1e-5) and torch.allclose(x[2], y[2], atol=1e-5) for x, y in zip(ga, gb)
            ),
            "params": all(torch.allclose(x, y, atol=1e-5) for x, y in zip(pa, pb)),
        }

    out = {name: close(r, reference) for name, r in runs.items()}
    out["placements_after_steps"] = runs["compiled_sharded_params"][3]
    out["frames"] = len(frames)
    return out


def test_training_step_matches_one_device_eager_and_compiled(ranks):
    for r in ranks["train"]:
        for run in ("eager", "compiled"):
            assert r[run] == {"loss": True, "grad_types": ["Tensor"], "grads": True, "params": True}, run
            # parameters sharded with mark_sharding: DTensor gradients, the same numbers
            assert r[f"{run}_sharded_params"] == {
                "loss": True,
                "grad_types": ["DTensor"],
                "grads": True,
                "params": True,
            }
        assert r["placements_after_steps"] == (("R", "S(1)"), ("R", "S(0)"))  # the optimizer keeps the layout
        assert r["frames"] == 2  # one graph for plain parameters, one for DTensor parameters; three steps each


@pytest.fixture(scope="module")
def ranks():
    """Both rank functions of this file, in one launch of 4 ranks."""
    return run_parts_on_ranks({"shards": _shards, "train": _train}, nproc=4)
