#!/usr/bin/env bash
# Installs SGLang 0.5.23's Python package beside vLLM's CPU build, once per machine, for the
# tests of kvtier's HiCache backend (py/tests/test_sglang.py), which build SGLang's own host
# pools on CPU tensors and call its own storage code:
#
#   ${KVTIER_CACHE:-$HOME/.cache/kvtier}/sglang-0.5.23/
#     site/    pip install --target: sglang 0.5.23 and the few modules its import of the
#              HiCache classes needs that the engine's venv lacks (orjson, IPython,
#              traitlets, gguf), all --no-deps
#     .ready   marker: a second run with the same pins is a no-op
#
# The packages go to a directory of their own, put on PYTHONPATH by the tests' runner only:
# SGLang's own requirements (its torch, transformers) would replace the engine venv's.
# PYTHON is the engine venv's python (scripts/vllm-cpu-setup.sh), whose torch SGLang uses.
#
# Prints the site directory on stdout (progress goes to stderr). Safe to run concurrently.
set -euo pipefail

pins="sglang==0.5.23 orjson==3.13.0 ipython==9.18.1 traitlets==5.16.1 gguf==0.19.0"
cache="${KVTIER_CACHE:-$HOME/.cache/kvtier}"
dir="$cache/sglang-0.5.23"
python="${PYTHON:?PYTHON must name the engine venv\'s python (scripts/vllm-cpu-setup.sh)}"

mkdir -p "$dir"
exec 9>"$dir/.lock"
flock 9

if [[ -f "$dir/.ready" && "$(cat "$dir/.ready")" == "$pins" && -d "$dir/site/sglang" ]]; then
    echo "$dir/site"
    exit 0
fi
echo "sglang-setup: installing $pins into $dir/site" >&2
rm -f "$dir/.ready"
rm -rf "$dir/site"
# shellcheck disable=SC2086
"$python" -m pip install --quiet --disable-pip-version-check --no-deps --only-binary=:all: \
    --target "$dir/site" $pins >&2
# The classes the tests use must import with the engine's torch.
PYTHONPATH="$dir/site" "$python" -W ignore -c '
from sglang.srt.mem_cache.hicache_storage import HiCacheFile
from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost
from sglang.srt.mem_cache.pool_host.mla import MLATokenToKVPoolHost
from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory
' >&2
echo "$pins" >"$dir/.ready"
echo "$dir/site"
