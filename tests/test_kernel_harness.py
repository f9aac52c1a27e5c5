"""W ranks in one process (NOTE [in-process ranks]): the fused kernels run concurrently against eager.

- CPU, ``TRITON_INTERPRET=1``: one thread per rank, 2 and 3 ranks, both kernels, fp32 and
  bf16, rows walked in chunks (``--max-block-n 16``), two back-to-back calls each (in a
  fresh process: ``triton.jit`` picks the interpreter when the kernels are imported).
  The tests of test_kernel_one_shot.py / test_kernel_two_shot.py cover unchunked rows.
- CUDA (``gpu`` marker): one stream per rank, 1000 back-to-back calls per size.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

pytest.importorskip("triton")

from dynamo_ext.inductor_lowerings.kernels import harness  # noqa: E402


def test_reference_keeps_the_kernel_summation_order_and_ulps_are_exact():
    xs = [torch.tensor([1.0]), torch.tensor([2.0**-24]), torch.tensor([2.0**-24])]
    s, _, _ = harness.reference_same_order(xs, torch.zeros(1), None, eps=1e-6)
    assert s.item() == 1.0  # ((0 + 1) + 2**-24) + 2**-24 rounds twice to 1; a pairwise sum would not
    one = torch.tensor([1.0], dtype=torch.bfloat16)
    assert harness.ulps(one + 2**-7, one) == 1.0 and harness.ulps(one, one) == 0.0
    assert (
        harness.ulps(torch.tensor([3.0 + 2**-6], dtype=torch.bfloat16), torch.tensor([3.0], dtype=torch.bfloat16)) == 1
    )


def test_ranks_as_threads_under_the_interpreter():
    env = {**os.environ, "TRITON_INTERPRET": "1", "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "dynamo_ext.inductor_lowerings.kernels.harness", "--world", "2", "3"]
    cmd += ["--sizes", "3x40", "--calls", "2", "--max-blocks", "2", "--max-block-n", "16"]  # 3 chunks a row
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    if proc.returncode == 2 and proc.stdout.startswith("skipped:"):
        pytest.skip(proc.stdout.strip())
    rows = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    assert len(rows) == 2 * 2 * 2, proc.stdout + proc.stderr[-3000:]  # worlds x dtypes x kernels
    bad = [r for r in rows if not r["ok"]]
    assert not bad and proc.returncode == 0, bad or proc.stderr[-3000:]
    assert all(r["sum_max_abs"] == 0 for r in rows if r["dtype"] == "float32")


def test_unknown_algorithm_is_refused():
    ranks = harness.InProcessRanks(1, 64, torch.device("cpu"))
    with pytest.raises(ValueError, match="expected one of"):
        ranks.all_reduce_residual_rms_norm("three_shot", [torch.zeros(2, 2)], torch.zeros(2, 2), None, eps=1e-6)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("world", [2, 4])
def test_ranks_as_streams_on_one_gpu_1000_calls(world):
    for algorithm, (rows, hidden), dtype in [
        ("one_shot", (1, 4096), torch.bfloat16),
        ("one_shot", (128, 4096), torch.float32),
        ("one_shot", (16, 16384), torch.bfloat16),  # chunked epilogue
        ("two_shot", (1024, 8192), torch.bfloat16),
    ]:
        nbytes = max(rows * hidden * 4, harness.two_shot.staging_nbytes((rows, hidden), dtype, dtype)) + 256
        ranks = harness.InProcessRanks(world, nbytes, torch.device("cuda"), max_blocks=8)
        got = ranks.race_check(algorithm, (rows, hidden), dtype, calls=1000)
        case = (algorithm, rows, hidden, dtype, got)
        assert got["ranks_disagree"] == 0 and got["slots_raised"] == 0, case
        if dtype == torch.float32:
            assert got["sum_max_abs"] == 0 and got["norm_max_ulp"] <= 8, case
        else:
            assert got["sum_max_ulp"] <= 1 and got["norm_max_ulp"] <= 1, case


def test_grid_comes_from_agreed_sizes_never_the_local_device():
    """``max_blocks`` from the signal pad size (the same on every rank) capped by a constant: no SM count query
    (this CPU machine has no device to ask, so a query would raise)."""
    import types

    from dynamo_ext.inductor_lowerings.kernels.peer_buffers import MAX_PROGRAMS, PeerBuffers

    def handle(pad_bytes):
        return types.SimpleNamespace(
            rank=1, world_size=4, signal_pad_size=pad_bytes, buffer_ptrs=[4096 * (r + 1) for r in range(4)],
            buffer_ptrs_dev=0, signal_pad_ptrs_dev=0, buffer_size=1 << 20,
        )  # fmt: skip

    big = PeerBuffers._from_handle(handle(1 << 20), torch.device("cuda", 0))
    small = PeerBuffers._from_handle(handle(4 * 4 * 5), torch.device("cuda", 7))
    assert (big.max_blocks, small.max_blocks) == (MAX_PROGRAMS, 5)
    assert big.aligned


def test_launch_config_chunks_long_rows_and_promises_alignment_only_when_true(tmp_path):
    from dynamo_ext.inductor_lowerings.kernels.fused_all_reduce_launch import launch_config
    from dynamo_ext.inductor_lowerings.kernels.peer_buffers import PeerBuffers, create_host_shared

    create_host_shared(str(tmp_path), world_size=3, buffer_nbytes=1 << 16, max_blocks=2)
    peers = PeerBuffers.open_host_shared(str(tmp_path), rank=0, world_size=3)
    bf16 = torch.bfloat16
    x = peers.local_tensor((2, 64), bf16)
    assert launch_config(peers, x, bf16) == {"PEERS": 4, "BLOCK_N": 64, "N_CHUNKS": 1, "VEC": 8, "num_warps": 1}
    assert launch_config(peers, x, torch.float32)["VEC"] == 8  # wider output: 8 elements still 16-byte aligned
    assert launch_config(peers, peers.local_tensor((2, 64), torch.float32), bf16)["VEC"] == 8  # bf16 rows: 8 elements
    assert launch_config(peers, peers.local_tensor((2, 60), bf16), bf16)["VEC"] == 1  # rows not a multiple of 8
    assert launch_config(peers, peers.local_tensor((2, 64), bf16, offset=4), bf16)["VEC"] == 1  # offset: 8 bytes
    long = launch_config(peers, peers.local_tensor((1, 10000), bf16), bf16)
    assert (long["BLOCK_N"], long["N_CHUNKS"], long["num_warps"]) == (4096, 3, 16)
