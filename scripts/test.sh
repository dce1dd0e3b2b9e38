#!/usr/bin/env bash
# Every test of kvtier, on a fresh machine: installs what the tests need beyond cargo (the
# vLLM 0.33.0 oracle, cached outside the clone, once per machine), then runs the workspace's
# tests, and the exhaustive stateright check in a release build (its closure of 7.3 million
# states takes about 11 minutes there; the test profile would take several times that, so it
# skips it). Extra arguments go to `cargo test`.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/vllm-oracle-setup.sh >/dev/null
cargo test --workspace "$@"
exec cargo test --release -p kvtier-model --test stateright "$@"
