#!/usr/bin/env python3
"""Writes the llama-cpp variant's test model: a small llama-architecture GGUF file with its
own tokenizer, from a seed, so that no one has to download a model to run the variant.

The weights are random (normal, scaled by 1/sqrt(fan-in)), so the model's answers are
noise: it emits byte tokens that are often not valid UTF-8 on their own, which the tests
use on purpose (the front door and the agent must pass such bytes on without breaking a
stream). What it is for is cost, not quality: each prompt token goes through every block,
so a prompt of about 2,000 tokens costs a clearly measurable prefill under QEMU TCG (the
positive control of `tenantvm verify`'s prefix-cache check), and llama-server's prompt
cache removes that cost for a repeated prefix.

The tokenizer is a SentencePiece-style ("llama") vocabulary: <unk>, <s>, </s>, the 256
byte tokens <0x00>..<0xFF> (byte fallback: any text can be encoded), the word-boundary
piece U+2581, the printable ASCII characters alone and after U+2581, and the most frequent
words of guest-image/corpus (so English text takes fewer tokens than bytes).

Same seed and same arguments give the same bytes (the writer's output is deterministic;
docs/guest-image.md). Needs the PyPI package gguf (pinned in requirements.txt beside this
file).

usage: make-test-model.py OUT.gguf [--seed N] [--blocks N] [--width N] [--ff N]
                          [--heads N] [--kv-heads N] [--context N] [--words N]
"""

import argparse
import collections
import os
import re
import sys

import gguf
import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
CORPUS = os.path.join(HERE, "..", "..", "corpus")
WORD_BOUNDARY = "\u2581"
CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def corpus_words(limit):
    """The `limit` most frequent lower-case words of guest-image/corpus, sorted by count
    then spelling (deterministic)."""
    counts = collections.Counter()
    if os.path.isdir(CORPUS):
        for name in sorted(os.listdir(CORPUS)):
            if name.endswith(".txt"):
                with open(os.path.join(CORPUS, name), encoding="utf-8") as f:
                    counts.update(re.findall(r"[a-z]{2,12}", f.read().lower()))
    ranked = sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))
    return [w for w, _ in ranked[:limit]]


def vocabulary(words):
    """Tokens, scores and token types of the tokenizer."""
    tokens, scores, types = [], [], []

    def add(text, score, kind):
        tokens.append(text)
        scores.append(score)
        types.append(kind)

    add("<unk>", 0.0, gguf.TokenType.UNKNOWN)
    add("<s>", 0.0, gguf.TokenType.CONTROL)
    add("</s>", 0.0, gguf.TokenType.CONTROL)
    for b in range(256):
        add(f"<0x{b:02X}>", 0.0, gguf.TokenType.BYTE)
    seen = set()
    # SentencePiece merges the highest-scoring pieces first: whole words beat characters.
    pieces = [WORD_BOUNDARY]
    pieces += [chr(c) for c in range(0x21, 0x7F)]
    pieces += [WORD_BOUNDARY + chr(c) for c in range(0x21, 0x7F)]
    for p in pieces:
        if p not in seen:
            seen.add(p)
            add(p, -1000.0 + len(p), gguf.TokenType.NORMAL)
    for i, w in enumerate(words):
        p = WORD_BOUNDARY + w
        if p not in seen:
            seen.add(p)
            add(p, -float(i), gguf.TokenType.NORMAL)
    return tokens, scores, types


def main(argv):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out")
    ap.add_argument("--seed", type=int, default=22)
    # Small on purpose: under QEMU 7.2's TCG (software floating point) a prompt token
    # costs milliseconds even for this model, and attention grows with the square of the
    # prompt, so a 2,000-token prefix already takes seconds to prefill (docs/benchmarks.md).
    ap.add_argument("--blocks", type=int, default=2)
    ap.add_argument("--width", type=int, default=64)
    ap.add_argument("--ff", type=int, default=128)
    ap.add_argument("--heads", type=int, default=2)
    ap.add_argument("--kv-heads", type=int, default=1)
    ap.add_argument("--context", type=int, default=8192)
    ap.add_argument("--words", type=int, default=512)
    ap.add_argument("--name", default="tenantvm-test-llama")
    a = ap.parse_args(argv)
    if a.width % a.heads or a.heads % a.kv_heads:
        ap.error("--width must be a multiple of --heads, --heads of --kv-heads")
    head_dim = a.width // a.heads
    kv_width = head_dim * a.kv_heads

    tokens, scores, types = vocabulary(corpus_words(a.words))
    rng = np.random.default_rng(a.seed)

    def matrix(rows, cols):
        # numpy's (rows, cols) is ggml's [cols, rows]: cols is the input width.
        w = rng.standard_normal((rows, cols), dtype=np.float32) / np.sqrt(cols)
        return w.astype(np.float16)

    def ones(n):
        return np.ones(n, dtype=np.float32)

    tmp = a.out + ".partial"
    w = gguf.GGUFWriter(tmp, "llama")
    w.add_name(a.name)
    w.add_description(f"tenantvm test model, random weights, seed {a.seed}")
    w.add_context_length(a.context)
    w.add_embedding_length(a.width)
    w.add_block_count(a.blocks)
    w.add_feed_forward_length(a.ff)
    w.add_head_count(a.heads)
    w.add_head_count_kv(a.kv_heads)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_rope_dimension_count(head_dim)
    w.add_rope_freq_base(10000.0)
    w.add_file_type(gguf.LlamaFileType.MOSTLY_F16)
    w.add_tokenizer_model("llama")
    w.add_token_list(tokens)
    w.add_token_scores(scores)
    w.add_token_types(types)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_unk_token_id(0)
    w.add_add_bos_token(True)
    w.add_add_eos_token(False)
    w.add_chat_template(CHAT_TEMPLATE)

    vocab = len(tokens)
    w.add_tensor("token_embd.weight", matrix(vocab, a.width))
    for i in range(a.blocks):
        p = f"blk.{i}."
        w.add_tensor(p + "attn_norm.weight", ones(a.width))
        w.add_tensor(p + "attn_q.weight", matrix(a.width, a.width))
        w.add_tensor(p + "attn_k.weight", matrix(kv_width, a.width))
        w.add_tensor(p + "attn_v.weight", matrix(kv_width, a.width))
        w.add_tensor(p + "attn_output.weight", matrix(a.width, a.width))
        w.add_tensor(p + "ffn_norm.weight", ones(a.width))
        w.add_tensor(p + "ffn_gate.weight", matrix(a.ff, a.width))
        w.add_tensor(p + "ffn_up.weight", matrix(a.ff, a.width))
        w.add_tensor(p + "ffn_down.weight", matrix(a.width, a.ff))
    w.add_tensor("output_norm.weight", ones(a.width))
    w.add_tensor("output.weight", matrix(vocab, a.width))

    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    os.replace(tmp, a.out)
    size = os.path.getsize(a.out)
    print(
        f"make-test-model: {a.out}: {a.blocks} blocks, width {a.width}, "
        f"{vocab} tokens, seed {a.seed}, {size} bytes",
        file=sys.stderr,
    )


if __name__ == "__main__":
    main(sys.argv[1:])
