#!/usr/bin/env bash
# Benchmarks concurrency over QEMU's multiplexed virtio-serial port (docs/guest-image.md,
# "Multiplexing the serial port"): one QEMU TCG guest-image tenant reached over the serial
# port (the daemon runs with --qemu-agent-transport virtio-serial, so the figure is the
# same with or without /dev/vhost-vsock), four inference requests with long prompts sent
# one at a time and then all at once, alternately, for a few rounds. Before the mux the
# port carried one request at a time and both figures were the same; with it, four at once
# take about the time of the slowest, bounded by the guest's vCPUs.
#
# usage: scripts/bench-serial-mux.sh        (root; /dev/kvm not needed: QEMU TCG)
#   TENANTVM_BENCH_ROUNDS=N   rounds (default 3)
#   TENANTVM_BENCH_WORDS=N    words per prompt (default 8000: prefill dominates)
#   TENANTVM_GUEST_IMAGE=DIR  a prebuilt image set (default: build one into target/)
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
rounds="${TENANTVM_BENCH_ROUNDS:-3}"
words="${TENANTVM_BENCH_WORDS:-8000}"
cargo build -q -p tenantvm -p tenantvm-jail --bins
bin="$root/target/debug"
image="${TENANTVM_GUEST_IMAGE:-$root/target/guest-image-bench}"
if [ ! -f "$image/manifest.json" ]; then
    echo "bench-serial-mux: building the guest image set into $image" >&2
    guest-image/build.sh "$image" >/dev/null
fi

w="$(mktemp -d "${TMPDIR:-/tmp}/tenantvm-bench-mux.XXXXXX")"
mkdir -p "$w/images"
cp -r "$image" "$w/images/ngram"
head -c 32 /dev/urandom >"$w/kek"
chmod 600 "$w/kek"
"$bin/tenantvmd" --state-dir "$w/state" --socket "$w/d.sock" --image-dir "$w/images" \
    --backend qemu-tcg --qemu-agent-transport virtio-serial --keyslot-cost test \
    --kek-file "$w/kek" >"$w/daemon.log" 2>&1 &
daemon=$!
cleanup() {
    TENANTVM_SOCKET="$w/d.sock" TENANTVM_TOKEN_FILE="$w/state/admin.token" \
        "$bin/tenantvm" destroy mux-bench --timeout-s 120 >/dev/null 2>&1 || true
    kill "$daemon" 2>/dev/null || true
    wait "$daemon" 2>/dev/null || true
    rm -rf "$w"
}
trap cleanup EXIT
for _ in $(seq 100); do
    [ -S "$w/d.sock" ] && [ -f "$w/state/admin.token" ] && break
    sleep 0.2
done
export TENANTVM_SOCKET="$w/d.sock" TENANTVM_TOKEN_FILE="$w/state/admin.token"
cat >"$w/t.toml" <<'EOF'
name = "mux-bench"
vcpus = 2
memory_mib = 256
disk_gib = 1
[image]
name = "ngram"
[quotas]
requests_per_s = 1000
max_concurrency = 8
EOF
"$bin/tenantvm" create "$w/t.toml" --timeout-s 300 >/dev/null 2>&1
python3 - "$w" "$words" <<'EOF'
import random, sys
w, words = sys.argv[1], int(sys.argv[2])
rng = random.Random(1)
for i in range(1, 5):
    text = " ".join("".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(3))
                    for _ in range(words))
    open(f"{w}/p{i}.txt", "w").write(text)
EOF
one() { "$bin/tenantvm" infer mux-bench "$(cat "$w/p$1.txt")" --max-tokens 8 >/dev/null; }
now() { date +%s.%N; }
since() { python3 -c "import sys; print(float(sys.argv[2]) - float(sys.argv[1]))" "$1" "$(now)"; }
for round in $(seq "$rounds"); do
    t=$(now)
    for i in 1 2 3 4; do one "$i"; done
    one_at_a_time=$(since "$t")
    t=$(now)
    pids=""
    for i in 1 2 3 4; do
        one "$i" &
        pids="$pids $!"
    done
    # shellcheck disable=SC2086
    wait $pids
    at_once=$(since "$t")
    python3 -c 'import sys; r, a, b = sys.argv[1:]; print(f"round {r}: 4 one at a time {float(a):.3f} s, 4 at once {float(b):.3f} s, ratio {float(a) / float(b):.2f}")' \
        "$round" "$one_at_a_time" "$at_once"
done
