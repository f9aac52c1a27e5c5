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
