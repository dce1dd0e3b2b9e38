#!/usr/bin/env bash
# Installs the vLLM 0.33.0 differential oracle outside the clone, once per machine.
#
#   ${KVTIER_CACHE:-$HOME/.cache/kvtier}/vllm-0.33.0/
#     wheel/   vllm==0.33.0 as `pip download --no-deps` fetched it
#     site/    only the parts of the wheel the oracle imports (see PARTS below)
#     sdist/   vllm-0.33.0.tar.gz, vLLM's source release on PyPI (checked against its sha256)
#     tests/   only vLLM's own manager tests from it (tests/v1/kv_offload/cpu/test_manager.py),
#              which py/tests/test_vllm_manager_suite.py runs against kvtier's manager
#     venv/    python3 -m venv with the managers' own third-party needs (numpy,
#              typing_extensions); torch and the rest of vLLM are faked by
#              model/oracle/fakes/
#     .ready   marker: a second run with the same layout is a no-op
#
# Prints the directory on stdout (progress goes to stderr). KVTIER_VLLM_WHEEL=PATH and
# KVTIER_VLLM_SDIST=PATH use an already-downloaded wheel or source release instead of asking
# PyPI. Safe to run concurrently (flock).
set -euo pipefail

version=0.33.0
# Bump when PARTS or the venv's packages change: a stale install is then rebuilt.
layout="layout 3: kv_offload, kv_connector/v1/offloading, math_utils, cache_hit_source; sdist tests/v1/kv_offload/cpu/test_manager.py; numpy 2.4.6, typing_extensions 4.16.0"
# The source release's digest, as PyPI lists it (47101396 bytes).
sdist_sha256=f4c33c2503d52bb411146afa9618a4f48bed68912f617e6803ac8d76e4c74112
# The one file taken from the source release: vLLM's manager tests (they import nothing from
# vLLM's tests/ tree; only vllm itself, numpy and pytest).
suite=tests/v1/kv_offload/cpu/test_manager.py
cache="${KVTIER_CACHE:-$HOME/.cache/kvtier}"
dir="$cache/vllm-$version"
python="${PYTHON:-python3}"

say() { echo "vllm-oracle-setup: $*" >&2; }

mkdir -p "$dir"
exec 9>"$dir/.lock"
flock 9

if [[ -f "$dir/.ready" && "$(cat "$dir/.ready")" == "$layout" && -x "$dir/venv/bin/python" &&
    -f "$dir/site/vllm/v1/kv_offload/cpu/manager.py" && -f "$dir/$suite" ]]; then
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

# 1b. The source release, once. PyPI's simple index (its JSON form) names the file, which is
# fetched as is and checked against the pinned digest. (`pip download --no-binary :all:` would
# build the release's metadata, which needs torch and a CUDA toolchain.)
sdist="$dir/sdist/vllm-$version.tar.gz"
if [[ ! -f "$sdist" ]]; then
    mkdir -p "$dir/sdist"
    if [[ -n "${KVTIER_VLLM_SDIST:-}" ]]; then
        say "using $KVTIER_VLLM_SDIST"
        cp "$KVTIER_VLLM_SDIST" "$sdist.part"
    else
        say "fetching vllm-$version.tar.gz from PyPI (about 47 MB)"
        "$python" - "$version" "$sdist.part" <<'EOF'
import json, shutil, sys, urllib.request
version, dest = sys.argv[1], sys.argv[2]
name = f"vllm-{version}.tar.gz"
index = urllib.request.Request(
    "https://pypi.org/simple/vllm/", headers={"Accept": "application/vnd.pypi.simple.v1+json"}
)
with urllib.request.urlopen(index, timeout=120) as r:
    files = [f for f in json.load(r)["files"] if f["filename"] == name]
if not files:
    sys.exit(f"PyPI lists no {name}")
with urllib.request.urlopen(files[0]["url"], timeout=600) as r, open(dest, "wb") as out:
    shutil.copyfileobj(r, out)
EOF
    fi
    got=$(sha256sum "$sdist.part" | cut -d' ' -f1)
    if [[ "$got" != "$sdist_sha256" ]]; then
        rm -f "$sdist.part"
        say "vllm-$version.tar.gz has sha256 $got, not $sdist_sha256"
        exit 1
    fi
    mv "$sdist.part" "$sdist"
fi

# 1c. vLLM's manager tests, and nothing else of the release.
rm -rf "$dir/tests"
"$python" - "$sdist" "$dir" "vllm-$version/$suite" <<'EOF'
import os, sys, tarfile
sdist, dest, member = sys.argv[1], sys.argv[2], sys.argv[3]
with tarfile.open(sdist) as t:
    try:
        f = t.extractfile(member)
    except KeyError:
        f = None
    if f is None:
        sys.exit(f"{sdist}: no {member}")
    path = os.path.join(dest, member.split("/", 1)[1])
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "wb") as out:
        out.write(f.read())
print(f"extracted {member}", file=sys.stderr)
EOF

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
