#!/bin/sh
# The llama.cpp variant's payload command. The agent runs it with busybox sh inside the
# engine's own root (/payload of the initramfs is its /) as an unprivileged user; /data is
# the tenant's decrypted disk. Serves one pushed GGUF model under its pushed name with
# llama-server on 127.0.0.1:8000 (the agent's health path: /health).
#
# Which model: $TENANTVM_MODEL if set (a name under /data/models), else the only entry of
# /data/models: a GGUF file NAME, or a directory NAME (a pushed model directory) holding
# model.gguf or exactly one *.gguf. A model pushed while it runs is served after
# `tenantvm payload restart TENANT`; until one is pushed, /health answers and /v1/models
# lists none (busybox httpd, static files), so a new tenant reaches running.
#
# Settings (the payload config's env): TENANTVM_CTX (context, split across the slots;
# default 8192), TENANTVM_PARALLEL (slots: requests served at once; default 2),
# TENANTVM_GPU_LAYERS (layers offloaded to the GPU; default 999 = all, ignored without a
# GPU backend), TENANTVM_LLAMA_ARGS (more llama-server arguments, split on spaces).
set -eu
models="${TENANTVM_MODELS_DIR:-/data/models}"
say() { echo "llama-cpp payload: $*" >&2; }

# The GGUF file of entry $1, or nothing.
gguf_of() {
    if [ -f "$1" ]; then
        echo "$1"
    elif [ -d "$1" ]; then
        if [ -f "$1/model.gguf" ]; then
            echo "$1/model.gguf"
            return
        fi
        found="" n=0
        for f in "$1"/*.gguf; do
            [ -f "$f" ] || continue
            found="$f" n=$((n + 1))
        done
        [ "$n" -eq 1 ] && echo "$found"
    fi
    return 0
}

if [ -n "${TENANTVM_MODEL:-}" ]; then
    name="$TENANTVM_MODEL"
    file="$(gguf_of "$models/$name")"
    [ -n "$file" ] || { say "$models/$name holds no GGUF model"; exit 2; }
else
    n=0 entry=""
    for e in "$models"/*; do
        [ -e "$e" ] || continue
        case "${e##*/}" in .*) continue ;; esac
        n=$((n + 1))
        entry="$e"
    done
    if [ "$n" -eq 0 ]; then
        say "no model in $models yet: push one with tenantvm model push TENANT FILE.gguf --name NAME, then tenantvm payload restart TENANT"
        exec busybox httpd -f -p 127.0.0.1:8000 -h /no-model
    fi
    [ "$n" -eq 1 ] || { say "$n models in $models: set TENANTVM_MODEL in the payload config"; exit 2; }
    name="${entry##*/}"
    file="$(gguf_of "$entry")"
    [ -n "$file" ] || { say "$entry holds no GGUF model (a file, or a directory with model.gguf or one *.gguf)"; exit 2; }
fi
# GGUF files start with the magic "GGUF"; anything else is refused before llama.cpp reads it.
[ "$(busybox head -c 4 "$file")" = GGUF ] || { say "$file is not a GGUF model (no GGUF magic)"; exit 2; }
say "serving $file as $name"
# shellcheck disable=SC2086 # TENANTVM_LLAMA_ARGS is a list of words on purpose.
exec llama-server --host 127.0.0.1 --port 8000 --model "$file" --alias "$name" \
    --n-gpu-layers "${TENANTVM_GPU_LAYERS:-999}" --ctx-size "${TENANTVM_CTX:-8192}" \
    --parallel "${TENANTVM_PARALLEL:-2}" --no-webui --metrics ${TENANTVM_LLAMA_ARGS:-}
