#!/usr/bin/env bash
# One prepared command for a lent GPU (issue 40): the GPU-gated tests under a watchdog, the race test, the fused
# all-reduce sweep and the bundled Llama's step, in about 8 minutes at most, figures in OUTDIR/gpu_check.json.
#   bash scripts/gpu_check.sh [OUTDIR]             # on the GPU machine (OUTDIR: default $OUT, else a /tmp folder)
#   bash scripts/gpu_check.sh --dry-run [OUTDIR]   # on a CPU: collects, imports, plans, runs the tiny CPU variants
#   bash scripts/gpu_check.sh --skip llama [OUTDIR] / --only race,bench   # phases: env compile tests race bench llama
# The phases, their budgets and the JSON: scripts/gpu_check.py; how to read the figures: benchmarks/README.md.
# Python: $PYTHON, else python3 (on the lent machine the one that holds torch); the package is used from this
# checkout (PYTHONPATH), nothing is installed.
set -uo pipefail
cd "$(dirname "$0")/.."
py=${PYTHON:-$(command -v python3 || command -v python)}
export PYTHONPATH="$PWD:$PWD/scripts${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1
exec "$py" scripts/gpu_check.py "$@"
