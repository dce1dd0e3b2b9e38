#!/usr/bin/env bash
# Every test of kvtier, on a fresh machine: installs what the tests need beyond cargo (the
# vLLM 0.33.0 oracle, cached outside the clone, once per machine), then runs the workspace's
# tests. Extra arguments go to `cargo test`.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/vllm-oracle-setup.sh >/dev/null
exec cargo test --workspace "$@"
