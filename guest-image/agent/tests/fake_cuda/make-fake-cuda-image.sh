#!/usr/bin/env bash
# TEST-ONLY: copies a guest image set (guest-image/build.sh) and installs the FAKE CUDA driver
# (fake_libcuda_alloc.c: no GPU, counts bytes) as /lib/x86_64-linux-gnu/libcuda.so.1 in its
# initramfs, answering out of memory past MIB (its built-in default: the agent's load worker
# runs with an empty environment), and rewrites the manifest's initramfs hash. With it,
# `tenantvm verify` check 4's GPU half runs end to end without a GPU (docs/verify.md):
# MIB under the probe's slice passes, MIB over it fails. Never an image for tenants.
#
# usage: make-fake-cuda-image.sh IMAGE_DIR OUT_DIR MIB
set -euo pipefail
src="${1:?usage: make-fake-cuda-image.sh IMAGE_DIR OUT_DIR MIB}"
out="${2:?usage: make-fake-cuda-image.sh IMAGE_DIR OUT_DIR MIB}"
mib="${3:?usage: make-fake-cuda-image.sh IMAGE_DIR OUT_DIR MIB}"
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
rm -rf "$out" "$out.root"
cp -r "$src" "$out"
mkdir "$out.root"
(cd "$out.root" && zcat "$src/initramfs.cpio.gz" | cpio -id --quiet)
cc -shared -fPIC -O2 -DFAKE_DEFAULT_MIB="$mib" \
    -o "$out.root/lib/x86_64-linux-gnu/libcuda.so.1" "$here/fake_libcuda_alloc.c"
(cd "$out.root" && find . -mindepth 1 | LC_ALL=C sort | cpio -o -H newc --quiet | gzip -n) \
    > "$out/initramfs.cpio.gz"
rm -rf "$out.root"
python3 - "$out" <<'PY'
import hashlib, json, os, sys
d = sys.argv[1]
path = os.path.join(d, "manifest.json")
m = json.load(open(path))
f = os.path.join(d, "initramfs.cpio.gz")
m["files"]["initramfs.cpio.gz"] = {
    "sha256": hashlib.sha256(open(f, "rb").read()).hexdigest(),
    "size": os.path.getsize(f),
}
json.dump(m, open(path, "w"), indent=2)
PY
echo "make-fake-cuda-image: $out (FAKE libcuda, $mib MiB)"
