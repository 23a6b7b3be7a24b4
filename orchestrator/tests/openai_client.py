#!/usr/bin/env python3
"""The official OpenAI Python client against tenantvm's TLS front door, as a tenant's
client application would use it (orchestrator/tests/e2e_llama_engine.rs runs it with the
pinned client in .cache/llama-cpp/venv). Prints one JSON object with what it saw; the Rust
test judges it.

usage: openai_client.py BASE_URL API_KEY CA_PEM MODEL

What it does: lists the models; streams a chat completion (random weights: many of the
tokens are bytes that are not UTF-8 on their own, which must not break the stream) and
times it as the client sees it beside the engine's own timings of the same request (the
figures in docs/benchmarks.md); asks
for a completion and reads its usage block; and, with the raw response, the engine's
system_fingerprint and timings (llama-server's, the n-gram server has neither).
"""

import json
import ssl
import sys
import time

import openai


def main(base_url, key, ca, model):
    http = openai.DefaultHttpx2Client(verify=ssl.create_default_context(cafile=ca), timeout=600)
    client = openai.OpenAI(base_url=base_url, api_key=key, http_client=http, max_retries=0)
    out = {}

    out["models"] = [m.id for m in client.models.list().data]

    started = time.monotonic()
    first = None
    chunks, text, finish, timings, pieces = 0, "", None, None, 0
    stream = client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": "Tell me about the harbour."}],
        max_tokens=48,
        temperature=1.0,
        seed=22,
        stream=True,
    )
    for chunk in stream:
        chunks += 1
        # llama-server puts its own timings in the last chunk.
        extra = chunk.model_extra or {}
        if extra.get("timings"):
            timings = extra["timings"]
        for choice in chunk.choices:
            if choice.delta and choice.delta.content:
                if first is None:
                    first = time.monotonic() - started
                pieces += 1
                text += choice.delta.content
            if choice.finish_reason:
                finish = choice.finish_reason
    ended = time.monotonic() - started
    out["chat_stream"] = {
        "chunks": chunks,
        "text": text,
        "finish_reason": finish,
        "replacement_chars": text.count("\ufffd"),
        "first_token_s": first,
        "end_s": ended,
        "content_pieces": pieces,
        "engine_timings": timings,
    }

    raw = client.completions.with_raw_response.create(
        model=model, prompt="four score and seven years", max_tokens=8, temperature=0
    )
    body = json.loads(raw.text)
    completion = raw.parse()
    out["completion"] = {
        "text": completion.choices[0].text,
        "usage": completion.usage.model_dump() if completion.usage else None,
        "system_fingerprint": body.get("system_fingerprint"),
        "timings": body.get("timings"),
        "content_type": raw.headers.get("content-type"),
    }

    try:
        client.embeddings.create(model=model, input="hello")
        out["embeddings"] = {"ok": True}
    except openai.APIStatusError as e:
        out["embeddings"] = {"ok": False, "status": e.status_code, "body": e.body}

    print(json.dumps(out))


if __name__ == "__main__":
    main(*sys.argv[1:5])
