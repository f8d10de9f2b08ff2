#!/usr/bin/env bash
# The core suite (-m "not slow and not distributed") on each torch version given, each
# in a virtual environment of its own, so the README's torch range is a tested claim.
#
#   scripts/torch_matrix.sh [VERSION ...]        default: 2.13.0 2.14.1
#
# Environments go under $GRAPHGEAR_MATRIX_DIR (default ~/.cache/graphgear/torch-matrix,
# XDG_CACHE_HOME respected), one per version, kept for the next run: versions other than
# the 2.13.0 CPU wheel are CUDA builds of ~5.5 GB each, so the folder is under the user's
# cache, never /tmp. Each version's pytest log is torch-VERSION.log there; the last line
# of the run is a summary per version. Exit status: 0 only if every version passed.
set -uo pipefail
unset PYTHONPATH  # each environment imports its own graphgear (this checkout, editable)

here="$(cd "$(dirname "$0")/.." && pwd)"
versions=("$@")
[ ${#versions[@]} -eq 0 ] && versions=(2.13.0 2.14.1)
root="${GRAPHGEAR_MATRIX_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/graphgear/torch-matrix}"
python="${PYTHON:-python3}"
mkdir -p "$root" && chmod 700 "$root"

declare -A result
status=0
for v in "${versions[@]}"; do
    if ! [[ "$v" =~ ^[0-9]+\.[0-9]+\.[0-9]+(\+[a-z0-9]+)?$ ]]; then
        echo "torch_matrix: '$v' is not a torch version (expected e.g. 2.14.1 or 2.13.0+cpu)" >&2
        exit 2
    fi
    env="$root/torch-$v"
    log="$root/torch-$v.log"
    echo "== torch $v: environment $env"
    if [ ! -x "$env/bin/python" ]; then
        "$python" -m venv "$env" || { result[$v]="venv failed"; status=1; continue; }
    fi
    if ! "$env/bin/python" -m pip install -q "torch==$v" -e "$here[test]" >"$log" 2>&1; then
        echo "torch_matrix: installing torch==$v failed; see $log" >&2
        tail -5 "$log" >&2
        result[$v]="install failed"
        status=1
        continue
    fi
    got="$("$env/bin/python" -c 'import torch; print(torch.__version__)')"
    echo "== torch $got: core suite (log: $log)"
    (cd "$here" && "$env/bin/python" -m pytest -m "not slow and not distributed" -q -p no:cacheprovider) \
        >>"$log" 2>&1
    rc=$?
    summary="$(grep -E '^(=+ )?[0-9]+ (passed|failed)' "$log" | tail -1 | sed 's/=//g; s/^ *//; s/ *$//')"
    result[$v]="torch $got: ${summary:-no pytest summary} (exit $rc)"
    [ $rc -eq 0 ] || status=1
    grep -E '^(FAILED|ERROR) ' "$log" | sed "s/^/    $v: /"
done

echo "== summary"
for v in "${versions[@]}"; do
    echo "$v: ${result[$v]:-not run}"
done
exit $status
