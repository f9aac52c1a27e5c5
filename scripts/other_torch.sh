#!/usr/bin/env bash
# Run dynamo-ext's tests and the shared corpus against another torch release.
#
#   scripts/other_torch.sh VERSION [pytest args...]
#   scripts/other_torch.sh 2.11.0 -x -q
#   DYNAMO_EXT_VENVS=/work/venvs scripts/other_torch.sh 2.15.0 -k guards
#
# Creates (or reuses) the venv ${DYNAMO_EXT_VENVS:-$HOME/.cache/dynamo-ext/venvs}/torch-VERSION,
# installs torch==VERSION there (with PIP_CONFIG_FILE=/dev/null, which lifts a
# machine-wide pip constraint capping torch), the test deps and this repo in
# editable mode (--no-deps), then runs
#   1. pytest on the repo's tests with the given args,
#   2. ../shared/corpus/run.py --plugin dynamo_ext --backend aot_eager (public cases + tests/corpus_cases.py),
#   3. ../shared/corpus/run.py --plugin dynamo_ext --backend eager.
# Every step runs even if an earlier one fails; the exit status is non-zero if
# any step failed (pytest's "no tests collected", exit 5, counts as a pass).
# The torch wheels are the ~5 GB CUDA builds; they run on CPU.  Not part of CI.
set -euo pipefail

if [[ $# -lt 1 || "$1" == -h || "$1" == --help ]]; then
    sed -n '2,17p' "$0" | sed 's/^# \{0,1\}//'
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
run() {
    echo "== $*"
    local rc=0
    "$@" || rc=$?
    if [[ $rc -ne 0 && ! ( $rc -eq 5 && "$2" == -m && "$3" == pytest ) ]]; then
        echo "== FAILED (exit $rc): $*"
        status=1
    fi
}

cd "$repo"
run "$py" -m pytest tests "$@"
if [[ -f "$corpus" ]]; then
    run "$py" "$corpus" --plugin dynamo_ext --backend aot_eager --cases-file "$repo/tests/corpus_cases.py"
    run "$py" "$corpus" --plugin dynamo_ext --backend eager --cases-file "$repo/tests/corpus_cases.py"
else
    echo "== corpus not found at $corpus; skipped"
    status=1
fi
echo "== torch $version: $([[ $status -eq 0 ]] && echo all steps passed || echo some step failed)"
exit $status
