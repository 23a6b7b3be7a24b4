#!/bin/sh
# The vLLM variant's payload command (the same payload contract as the llama.cpp variant's
# serve.sh). The agent runs it inside the engine's own root (/payload of the image is its
# /) as an unprivileged user; /data is the tenant's decrypted disk. Serves one pushed
# Hugging-Face model directory under its pushed name with vLLM's OpenAI-compatible server
# on 127.0.0.1:8000 (the agent's health path: /health).
#
# Which model: $TENANTVM_MODEL if set (a directory under /data/models), else the only
# directory of /data/models; it must hold config.json. Until one is pushed, /health answers
# and /v1/models lists none (python3's http.server over static files), so a new tenant
# reaches running; a model pushed later is served after `tenantvm payload restart TENANT`.
#
# Settings (the payload config's env): TENANTVM_GPU_MEMORY (vLLM's
# --gpu-memory-utilization; default 0.9), TENANTVM_MAX_MODEL_LEN (--max-model-len; default:
# the model's), TENANTVM_VLLM_ARGS (more arguments, split on spaces). Nothing is fetched:
# HF_HUB_OFFLINE=1, and the weights are the pushed files.
set -eu
models="${TENANTVM_MODELS_DIR:-/data/models}"
say() { echo "vllm payload: $*" >&2; }

if [ -n "${TENANTVM_MODEL:-}" ]; then
    dir="$models/$TENANTVM_MODEL"
else
    n=0 dir=""
    for e in "$models"/*; do
        [ -d "$e" ] || continue
        case "${e##*/}" in .*) continue ;; esac
        n=$((n + 1))
        dir="$e"
    done
    if [ "$n" -eq 0 ]; then
        say "no model directory in $models yet: push one with tenantvm model push TENANT DIR --name NAME, then tenantvm payload restart TENANT"
        cd /no-model
        exec python3 -m http.server --bind 127.0.0.1 8000
    fi
    [ "$n" -eq 1 ] || { say "$n model directories in $models: set TENANTVM_MODEL in the payload config"; exit 2; }
fi
[ -f "$dir/config.json" ] || { say "$dir is not a Hugging-Face model directory (no config.json)"; exit 2; }
name="${dir##*/}"
say "serving $dir as $name"
set -- --model "$dir" --served-model-name "$name" --host 127.0.0.1 --port 8000 \
    --gpu-memory-utilization "${TENANTVM_GPU_MEMORY:-0.9}"
[ -z "${TENANTVM_MAX_MODEL_LEN:-}" ] || set -- "$@" --max-model-len "$TENANTVM_MAX_MODEL_LEN"
# shellcheck disable=SC2086 # TENANTVM_VLLM_ARGS is a list of words on purpose.
exec python3 -m vllm.entrypoints.openai.api_server "$@" ${TENANTVM_VLLM_ARGS:-}
