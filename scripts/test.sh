#!/usr/bin/env bash
# The test command (README "Set up"): installs what the suite needs, then runs it.
#   bash scripts/test.sh            # the default suite (what CI runs; tests marked slow are left out)
#   bash scripts/test.sh -m ""      # everything, the slow tests too
#   bash scripts/test.sh -k guards  # extra arguments go to pytest
#   DYNAMO_EXT_TEST_TORCH=2.15.0 bash scripts/test.sh   # the suite on another torch release
#   DYNAMO_EXT_TEST_TITAN=1 ...      # torchtitan 0.3.0 too (needs torch 2.15; CI's 2.15 stage sets it)
# Installs: torch ${DYNAMO_EXT_TEST_TORCH:-2.13.0} (2.13.0 is a CPU build; the registry's newer releases are
# CUDA builds, about 5 GB, that run on the CPU), this package with its [test] extras, and Debian's chromium
# for the audit's HTML screenshot test when apt-get is usable (root).  Stops if the torch that pip left
# installed is not the release asked for (pip may pick another one to satisfy a dependency or a constraint).
set -euo pipefail
cd "$(dirname "$0")/.."

torch_version=${DYNAMO_EXT_TEST_TORCH:-2.13.0}
python -m pip install --quiet --disable-pip-version-check "torch==$torch_version" -e ".[test]"
rm -rf dynamo_ext.egg-info 2>/dev/null || true
if [[ "${DYNAMO_EXT_TEST_TITAN:-0}" == 1 ]]; then
  # torchtitan's own training step (tests/test_titan030_gloo.py, which skips without it): torchtitan without its
  # declared dependencies (wandb, its checkpointing package, ...), then what the modules the tests import need
  python -m pip install --quiet --disable-pip-version-check --no-deps "torchtitan==0.3.0"
  python -m pip install --quiet --disable-pip-version-check -r tests/titan_requirements.txt
fi
have=$(python -c 'import torch; print(torch.__version__.split("+")[0])')
if [[ "$have" != "$torch_version" ]]; then
  echo "scripts/test.sh: asked for torch $torch_version, pip left torch $have installed" >&2
  exit 3
fi
echo "== torch $(python -c 'import torch; print(torch.__version__)')"

if ! command -v chromium >/dev/null 2>&1 && command -v apt-get >/dev/null 2>&1 && [ "$(id -u)" = 0 ]; then
  (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null) \
    || echo "chromium could not be installed: the HTML screenshot test will be skipped"
fi

export OMP_NUM_THREADS=1
exec python -m pytest -q -ra "$@"
