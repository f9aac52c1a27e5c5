#!/usr/bin/env bash
# Run dynamo-ext's tests and the shared corpus against another torch release, and record the results.
#
#   scripts/other_torch.sh VERSION [pytest args...]
#   scripts/other_torch.sh 2.11.0 -x -q
#   DYNAMO_EXT_VENVS=/work/venvs scripts/other_torch.sh 2.15.0 -k guards
#
# Creates (or reuses) the venv ${DYNAMO_EXT_VENVS:-$HOME/.cache/dynamo-ext/venvs}/torch-VERSION,
# installs torch==VERSION there (with PIP_CONFIG_FILE=/dev/null, which lifts a
# machine-wide pip constraint capping torch), the test deps and this repo in
# editable mode (--no-deps), then runs
#   1. pytest on the repo's tests with the given args (on tests/ unless they name test files),
#   2. ../shared/corpus/run.py --plugin dynamo_ext --backend aot_eager (public cases + tests/corpus_cases.py),
#   3. ../shared/corpus/run.py --plugin dynamo_ext --backend eager,
#   4. records them: docs/support/runs/VERSION.json (pass/fail/skip counts from pytest's JUnit XML, the
#      corpus's --json rows, date, torch.__version__, commit), docs/support/api_presence/VERSION.json (which
#      private torch APIs the plugin uses exist there), then regenerates docs/support.md's tables
#      (scripts/support_table.py).  DYNAMO_EXT_RECORD=0 skips this step.
# Every step runs even if an earlier one fails; the exit status is non-zero if
# any step failed (pytest's "no tests collected", exit 5, counts as a pass).
# With pytest args other than reporting ones (-q, -v, -ra, ...) the recorded run is marked partial in the
# table, its args shown; without, it is the whole default suite.  The torch wheels are the ~5 GB CUDA
# builds; they run on CPU.  Not part of CI.
set -euo pipefail

if [[ $# -lt 1 || "$1" == -h || "$1" == --help ]]; then
    awk 'NR > 1 && /^#/ { sub(/^# ?/, ""); print; next } NR > 1 { exit }' "$0"
    exit 2
fi
version=$1
shift

repo=$(git -C "$(dirname "$0")" rev-parse --show-toplevel)
corpus="$repo/../shared/corpus/run.py"
venvs=${DYNAMO_EXT_VENVS:-$HOME/.cache/dynamo-ext/venvs}
venv="$venvs/torch-$version"
py="$venv/bin/python"

if [[ ! -x "$py" ]]; then
    mkdir -p "$venvs"
    python3 -m venv "$venv"
fi

have=$("$py" -c 'import torch; print(torch.__version__.split("+")[0])' 2>/dev/null || true)
if [[ "$have" != "$version" ]]; then
    echo "== installing torch==$version into $venv"
    PIP_CONFIG_FILE=/dev/null "$py" -m pip install --progress-bar off "torch==$version"
fi
if ! "$py" -c 'import pytest, expecttest, hypothesis, rich, numpy' 2>/dev/null; then
    "$py" -m pip install --progress-bar off pytest expecttest hypothesis rich numpy
fi
# Always (re)link the editable install: the venv may have been made from another checkout.
# The build leaves dynamo_ext.egg-info/ in the work tree; remove it unless it was there before.
had_egg_info=$([[ -d "$repo/dynamo_ext.egg-info" ]] && echo 1 || echo 0)
pip_log=$(mktemp)
if ! "$py" -m pip install --quiet --no-deps -e "$repo" >"$pip_log" 2>&1; then
    cat "$pip_log"
    rm -f "$pip_log"
    exit 1
fi
rm -f "$pip_log"
[[ $had_egg_info == 1 ]] || rm -rf "$repo/dynamo_ext.egg-info"

status=0
# Runs a step; its exit status is left in $rc.
run() {
    echo "== $*"
    rc=0
    "$@" || rc=$?
    if [[ $rc -ne 0 && ! ( $rc -eq 5 && "$2" == -m && "$3" == pytest ) ]]; then
        echo "== FAILED (exit $rc): $*"
        status=1
    fi
}

results=$(mktemp -d)
trap 'rm -rf "$results"' EXIT
cd "$repo"
# pytest runs tests/ unless the args name test files or directories themselves.
targets=(tests)
for arg in "$@"; do
    [[ "$arg" != -* && -e "${arg%%::*}" ]] && targets=()
done
run "$py" -m pytest "${targets[@]}" "$@" --junitxml="$results/junit.xml" -o junit_family=xunit1
record=(--pytest-exit "$rc" --junit "$results/junit.xml")
if [[ -f "$corpus" ]]; then
    for backend in aot_eager eager; do
        run "$py" "$corpus" --plugin dynamo_ext --backend "$backend" --cases-file "$repo/tests/corpus_cases.py" \
            --json "$results/corpus_$backend.json"
        record+=(--corpus "$backend=$rc:$results/corpus_$backend.json")
    done
else
    echo "== corpus not found at $corpus; skipped"
    status=1
fi
if [[ "${DYNAMO_EXT_RECORD:-1}" != 0 ]]; then
    torch_version=$("$py" -c 'import torch; print(torch.__version__)')
    run "$py" scripts/support_table.py record-run --torch-version "$torch_version" "${record[@]}" -- "$@"
    run "$py" scripts/support_table.py probe --python "$py"
    run "$py" scripts/support_table.py write
fi
echo "== torch $version: $([[ $status -eq 0 ]] && echo all steps passed || echo some step failed)"
exit $status
