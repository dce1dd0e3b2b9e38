#!/usr/bin/env bash
# Installs the vLLM 0.33.0 differential oracle outside the clone, once per machine.
#
#   ${KVTIER_CACHE:-$HOME/.cache/kvtier}/vllm-0.33.0/
#     wheel/   vllm==0.33.0 as `pip download --no-deps` fetched it
#     site/    only the parts of the wheel the oracle imports (see PARTS below)
#     venv/    python3 -m venv with the managers' own third-party needs (numpy,
#              typing_extensions); torch and the rest of vLLM are faked by
#              model/oracle/fakes/
#     .ready   marker: a second run with the same layout is a no-op
#
# Prints the directory on stdout (progress goes to stderr). KVTIER_VLLM_WHEEL=PATH uses an
# already-downloaded wheel instead of asking PyPI. Safe to run concurrently (flock).
set -euo pipefail

version=0.33.0
# Bump when PARTS or the venv's packages change: a stale install is then rebuilt.
layout="layout 2: kv_offload, kv_connector/v1/offloading, math_utils, cache_hit_source; numpy 2.4.6, typing_extensions 4.16.0"
cache="${KVTIER_CACHE:-$HOME/.cache/kvtier}"
dir="$cache/vllm-$version"
python="${PYTHON:-python3}"

say() { echo "vllm-oracle-setup: $*" >&2; }

mkdir -p "$dir"
exec 9>"$dir/.lock"
flock 9

if [[ -f "$dir/.ready" && "$(cat "$dir/.ready")" == "$layout" && -x "$dir/venv/bin/python" &&
    -f "$dir/site/vllm/v1/kv_offload/cpu/manager.py" ]]; then
    echo "$dir"
    exit 0
fi

say "installing vLLM $version oracle into $dir"
rm -f "$dir/.ready"

# 1. The wheel, once.
wheel=$(ls "$dir"/wheel/vllm-"$version"-*.whl 2>/dev/null | head -n1 || true)
if [[ -z "$wheel" ]]; then
    mkdir -p "$dir/wheel"
    if [[ -n "${KVTIER_VLLM_WHEEL:-}" ]]; then
        say "using $KVTIER_VLLM_WHEEL"
        cp "$KVTIER_VLLM_WHEEL" "$dir/wheel/"
    else
        say "pip download --no-deps vllm==$version (about 340 MB)"
        "$python" -m pip download --quiet --disable-pip-version-check --no-deps --only-binary=:all: \
            --dest "$dir/wheel.part" "vllm==$version" >&2
        mv "$dir"/wheel.part/vllm-"$version"-*.whl "$dir/wheel/"
        rm -rf "$dir/wheel.part"
    fi
    wheel=$(ls "$dir"/wheel/vllm-"$version"-*.whl | head -n1)
fi

# 2. The parts of vLLM the oracle runs. The package __init__ files above them are left out on
# purpose: vllm/__init__.py and friends import torch, CUDA and the whole engine. Without them
# `vllm`, `vllm.v1`, `vllm.distributed`, ... are namespace packages that merge this tree with
# model/oracle/fakes/, which supplies the few outside modules the managers import.
rm -rf "$dir/site"
"$python" - "$wheel" "$dir/site" <<'EOF'
import sys, zipfile
wheel, dest = sys.argv[1], sys.argv[2]
PARTS = (
    "vllm/v1/kv_offload/",
    "vllm/distributed/kv_transfer/kv_connector/v1/offloading/",
    "vllm/utils/math_utils.py",
    "vllm/v1/metrics/cache_hit_source.py",
)
with zipfile.ZipFile(wheel) as z:
    names = [n for n in z.namelist() if n.startswith(PARTS) and n.endswith(".py")]
    names += [n for n in z.namelist() if n.endswith(".dist-info/METADATA")]
    if not any(n == "vllm/v1/kv_offload/cpu/manager.py" for n in names):
        sys.exit(f"{wheel}: no vllm/v1/kv_offload/cpu/manager.py in the wheel")
    for n in names:
        z.extract(n, dest)
print(f"extracted {len(names)} files", file=sys.stderr)
EOF

# 3. The venv with what the managers themselves import from outside vLLM.
rm -rf "$dir/venv"
"$python" -m venv "$dir/venv"
"$dir/venv/bin/python" -m pip install --quiet --disable-pip-version-check "numpy==2.4.6" "typing_extensions==4.16.0" >&2
PYTHONDONTWRITEBYTECODE=1 "$dir/venv/bin/python" - "$dir" "$(cd "$(dirname "$0")/.." && pwd)/model/oracle" <<'EOF'
import sys
install, oracle = sys.argv[1], sys.argv[2]
sys.path[:0] = [oracle]
import vllm_oracle
vllm_oracle.load_vllm(install)
print("imports ok", file=sys.stderr)
EOF

echo "$layout" >"$dir/.ready"
say "ready"
echo "$dir"
