#!/bin/sh
# The llama.cpp variant's payload command (runs as the agent's payload; /data is the
# tenant's decrypted disk). Serves one pushed GGUF model under its pushed name with
# llama.cpp's OpenAI-compatible server on 127.0.0.1:8000 (the agent's health path /health).
#
# Which model: $TENANTVM_MODEL if set (a name under /data/models), else the only entry of
# /data/models that holds a GGUF file (a file NAME, or a directory NAME with model.gguf).
# A model pushed while it runs is served after `tenantvm stop` and `tenantvm start`; until
# one is pushed, /health answers and /v1/models lists none.
set -eu
models="${TENANTVM_MODELS_DIR:-/data/models}"
pick() {
    for e in "$models"/*; do
        [ -e "$e" ] || continue
        case "${e##*/}" in .*) continue ;; esac
        if [ -f "$e" ]; then echo "$e"; elif [ -f "$e/model.gguf" ]; then echo "$e/model.gguf"; fi
    done
}
if [ -n "${TENANTVM_MODEL:-}" ]; then
    name="$TENANTVM_MODEL"
    file="$models/$name"
    [ -d "$file" ] && file="$file/model.gguf"
else
    found="$(pick)"
    if [ -z "$found" ]; then
        # No model yet (a new tenant): answer the agent's health probe and an empty model
        # list from static files, so the tenant reaches running and can be pushed to.
        echo "llama-cpp payload: no model in $models yet: push one with tenantvm model push TENANT FILE.gguf --name NAME, then stop and start the tenant" >&2
        exec busybox httpd -f -p 127.0.0.1:8000 -h /payload/no-model
    fi
    [ "$(printf '%s\n' "$found" | wc -l)" -eq 1 ] || { echo "llama-cpp payload: several models in $models: set TENANTVM_MODEL in the payload config" >&2; exit 2; }
    file="$found"
    name="${file#"$models"/}"
    name="${name%/model.gguf}"
fi
[ -f "$file" ] || { echo "llama-cpp payload: $file is not there" >&2; exit 2; }
# GGUF files start with the magic "GGUF"; anything else is refused before llama.cpp reads it.
[ "$(head -c 4 "$file")" = GGUF ] || { echo "llama-cpp payload: $file is not a GGUF model" >&2; exit 2; }
exec llama-server --host 127.0.0.1 --port 8000 --model "$file" --alias "$name" \
    --n-gpu-layers "${TENANTVM_GPU_LAYERS:-999}" --ctx-size "${TENANTVM_CTX:-4096}" \
    --parallel "${TENANTVM_PARALLEL:-4}" --no-webui
