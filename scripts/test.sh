#!/usr/bin/env bash
# Every test of kvtier, on a fresh machine: installs what the tests need beyond cargo, once per
# machine (redis-server for the shared tier's tests; cached outside the clone: the vLLM 0.33.0
# oracle with vLLM's own manager tests from its source release, and a Python venv with maturin,
# pytest and numpy), then runs
#   1. the workspace's tests;
#   2. the exhaustive stateright check in a release build (its closure of 7.3 million states
#      takes about 11 minutes there; the test profile would take several times that, so it
#      skips it);
#   3. the Python package: `pip install ./py` into the venv (the README's install command),
#      then its pytest suite against vLLM 0.33.0's own classes and tests (`-rsx`: the
#      reason of every skipped or expected-to-fail test is printed).
# Extra arguments go to `cargo test`.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/redis-setup.sh
bash scripts/vllm-oracle-setup.sh >/dev/null
venv=$(bash scripts/py-setup.sh)
cargo test --workspace "$@"
cargo test --release -p kvtier-model --test stateright "$@"
echo "== the Python package (pip install ./py, then pytest py/tests)" >&2
PATH="$venv/bin:$PATH" "$venv/bin/pip" install --quiet --disable-pip-version-check --no-build-isolation \
    --force-reinstall --no-deps ./py
exec "$venv/bin/python" -m pytest -q -rsx py/tests
