#!/usr/bin/env bash
# Prepares what the llama.cpp engine's tests, benchmark and demo use, all under .cache/
# (never committed), each step skipped when its inputs did not change:
#
#   .cache/llama-cpp/venv             Python tools pinned in requirements.txt (gguf, the
#                                     OpenAI client), in a virtual environment of their own
#   .cache/llama-cpp/test-model.gguf  the test model (make-test-model.py, fixed seed)
#   .cache/guest-image-llama-cpp      the variant's image set (build.sh --ggml-cpu x64:
#                                     the CPU variant QEMU's TCG runs fastest)
#
# usage: guest-image/variants/llama-cpp/prepare.sh [--tools]   (--tools: the first two only)
# Needs root, python3 with venv, mmdebstrap and a Debian mirror (scripts/setup.sh). Prints
# how long each step took (the CI time this engine's tests add).
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
root="$(cd "$here/../../.." && pwd)"
cache="$root/.cache/llama-cpp"
mkdir -p "$cache"
tools_only=0
[ "${1:-}" = --tools ] && tools_only=1

say() { printf '\033[1mllama-cpp prepare:\033[0m %s\n' "$*" >&2; }
now() { date +%s.%N; }
took() { awk "BEGIN {printf \"%.1f\", $(now) - $1}"; }

# 1. The Python tools (stamped with the requirements' hash).
t=$(now)
stamp="$(sha256sum "$here/requirements.txt" | cut -c1-16)"
if [ "$(cat "$cache/venv/.stamp" 2>/dev/null)" != "$stamp" ]; then
    say "installing the pinned Python tools into $cache/venv"
    rm -rf "$cache/venv"
    python3 -m venv "$cache/venv"
    "$cache/venv/bin/pip" install --quiet --disable-pip-version-check -r "$here/requirements.txt"
    echo "$stamp" >"$cache/venv/.stamp"
fi
say "python tools: $(took "$t") s"

# 2. The test model (stamped with the generator's and the corpus's hash).
t=$(now)
stamp="$(cat "$here/make-test-model.py" "$here/requirements.txt" "$root"/guest-image/corpus/*.txt | sha256sum | cut -c1-16)"
if [ "$(cat "$cache/test-model.stamp" 2>/dev/null)" != "$stamp" ] || [ ! -f "$cache/test-model.gguf" ]; then
    "$cache/venv/bin/python" "$here/make-test-model.py" "$cache/test-model.gguf"
    echo "$stamp" >"$cache/test-model.stamp"
fi
say "test model: $(took "$t") s"
[ "$tools_only" = 1 ] && exit 0

# 3. The variant's image set (the payload root is cached by build.sh itself), rebuilt
# unless guest-image/ is committed and unchanged since the last build.
t=$(now)
out="$root/.cache/guest-image-llama-cpp"
stamp=""
if git -C "$root" diff --quiet HEAD -- guest-image Cargo.lock 2>/dev/null &&
    [ -z "$(git -C "$root" ls-files --others --exclude-standard -- guest-image)" ]; then
    stamp="$(git -C "$root" rev-parse HEAD:guest-image):$(git -C "$root" rev-parse HEAD:Cargo.lock)"
fi
if [ -z "$stamp" ] || [ "$(cat "$out/.stamp" 2>/dev/null)" != "$stamp" ] || [ ! -f "$out/manifest.json" ]; then
    "$here/build.sh" --ggml-cpu x64 "$out"
    [ -z "$stamp" ] || echo "$stamp" >"$out/.stamp"
fi
say "image set: $(took "$t") s"
