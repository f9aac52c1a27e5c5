#!/usr/bin/env bash
# The test command (README "Set up"): installs what the suite needs, then runs it.
#   bash scripts/test.sh            # the default suite (what CI runs; tests marked slow are left out)
#   bash scripts/test.sh -m ""      # everything, the slow tests too
#   bash scripts/test.sh -k guards  # extra arguments go to pytest
# Installs: torch 2.13.0 (CPU), this package with its [test] extras, and Debian's
# chromium for the audit's HTML screenshot test when apt-get is usable (root).
set -euo pipefail
cd "$(dirname "$0")/.."

python -m pip install --quiet --disable-pip-version-check "torch==2.13.0" -e ".[test]"
rm -rf dynamo_ext.egg-info 2>/dev/null || true

if ! command -v chromium >/dev/null 2>&1 && command -v apt-get >/dev/null 2>&1 && [ "$(id -u)" = 0 ]; then
  (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null) \
    || echo "chromium could not be installed: the HTML screenshot test will be skipped"
fi

export OMP_NUM_THREADS=1
exec python -m pytest -q -ra "$@"
