#!/usr/bin/env bash
# Installs what the Python package's tests need outside the clone, once per machine:
#
#   ${KVTIER_CACHE:-$HOME/.cache/kvtier}/py-venv/   python3 -m venv with maturin (to build the
#                                                   wheel), pytest and numpy, pinned
#
# Prints the venv's directory on stdout (progress goes to stderr). A second run with the same
# pins is a no-op. Safe to run concurrently (flock).
set -euo pipefail

pins="maturin==1.9.6 pytest==8.4.2 numpy==2.4.6 typing_extensions==4.16.0"
cache="${KVTIER_CACHE:-$HOME/.cache/kvtier}"
dir="$cache/py-venv"
python="${PYTHON:-python3}"

mkdir -p "$cache"
exec 9>"$cache/.py-venv.lock"
flock 9

if [[ -x "$dir/bin/python" && -f "$dir/.ready" && "$(cat "$dir/.ready")" == "$pins" ]]; then
    echo "$dir"
    exit 0
fi
echo "py-setup: making $dir ($pins)" >&2
rm -rf "$dir"
"$python" -m venv "$dir"
# shellcheck disable=SC2086
"$dir/bin/python" -m pip install --quiet --disable-pip-version-check $pins >&2
echo "$pins" >"$dir/.ready"
echo "$dir"
