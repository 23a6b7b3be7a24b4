#!/usr/bin/env bash
# The tenant lifecycle demo: builds tenantvm, starts the daemon in a temporary state
# directory, creates two tenants that each run a test guest in their own jailed KVM VM,
# shows list, status and logs, destroys one, shows what is left, then runs a Linux guest
# tenant (guest image, encrypted disk, inference) under QEMU software emulation through
# create, infer, a second request refused by its rate quota, destroy and its receipt, and,
# when guest-image/variants/llama-cpp/prepare.sh has built it, a tenant whose engine is
# Debian's llama-server (model push, payload restart, a completion, destroy), then
# stops the daemons and removes everything. In between, a GPU tenant on a SIMULATED GPU host
# (8 H100s described in a file; no GPU is touched and the output and receipt say so): the
# planner places it, the daemon records the route, and its departure is receipted.
#
# usage: scripts/demo.sh          (as root, on a host with /dev/kvm; run scripts/setup.sh first)
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"

bold() { printf '\n\033[1m== %s\033[0m\n' "$*"; }
run() { printf '\033[2m$ %s\033[0m\n' "$*"; "$@"; }

if [ "$(id -u)" -ne 0 ]; then
    echo "demo: run as root: tenantvmd sets up per-tenant uids, cgroups and namespaces" >&2
    exit 1
fi
if [ ! -w /dev/kvm ]; then
    echo "demo: /dev/kvm is missing or not writable; enable virtualisation (or nested virtualisation) first" >&2
    exit 1
fi

bold "Building tenantvm (daemon, CLI, jail launcher) and tenantvm-vmm"
cargo build -q -p tenantvm -p tenantvm-jail -p tenantvm-vmm --bins
bin="$root/target/debug"

work="$(mktemp -d /tmp/tvmdemo.XXXXXX)"
state="$work/state"
sock="$work/tenantvmd.sock"
daemon_pid=""
cleanup() {
    if [ -n "$daemon_pid" ] && kill -0 "$daemon_pid" 2>/dev/null; then
        # Leave no VM behind, even if the demo stopped half-way.
        for t in $("$bin/tenantvm" --socket "$sock" --token-file "$state/admin.token" list --json 2>/dev/null \
                   | python3 -c 'import json,sys; print(" ".join(t["name"] for t in json.load(sys.stdin)["tenants"]))' 2>/dev/null); do
            "$bin/tenantvm" --socket "$sock" --token-file "$state/admin.token" destroy "$t" >/dev/null 2>&1 || true
        done
        kill -TERM "$daemon_pid" 2>/dev/null || true
        wait "$daemon_pid" 2>/dev/null || true
    fi
    rm -rf "$work"
}
trap cleanup EXIT

bold "Guest image"
mkdir -p "$work/images/hello"
if scripts/build-test-guests.sh && [ -f target/test-guests/tvm-testguest ]; then
    # The no_std test guest's `idle` test: prints TVMTEST idle READY, then a tick every 100 ms.
    cp target/test-guests/tvm-testguest "$work/images/hello/kernel"
    echo "console=ttyS0 tvm.test=idle" >"$work/images/hello/cmdline"
    echo "using the no_std test guest (tests/guests), running its idle test"
else
    echo "demo: the test guests did not build (see above); using the tiny idle guest instead" >&2
    python3 scripts/make-idle-guest.py "$work/images/hello/kernel" "hello from a tenantvm guest"
    echo "console=ttyS0" >"$work/images/hello/cmdline"
fi

bold "Starting tenantvmd (state in $state)"
# Other tenantvm daemons (tests) may run on this host: each keeps its tenants' cgroups in
# its own subtree (tenantvm/<hash of its state dir>/), so they never touch each other's.
# --kek-file/--keyslot-cost: a throwaway host KEK and the cheap test keyslot cost (demo only).
# --vcpu-overcommit: the demo's two 1-vCPU tenants must fit on a one-CPU machine too.
# --gpu-backend sim:FILE: a SIMULATED GPU host (8 H100s described in a file), for the GPU
# tenant below; nothing real is touched.
cp tests/fixtures/hosts/sim-h100x8.json "$work/sim-gpus.json"
"$bin/tenantvmd" --state-dir "$state" --socket "$sock" --image-dir "$work/images" \
    --kek-file "$work/host-kek" --keyslot-cost test --vcpu-overcommit 4 \
    --gpu-backend "sim:$work/sim-gpus.json" \
    >"$work/tenantvmd.log" 2>&1 &
daemon_pid=$!
for _ in $(seq 1 200); do [ -S "$sock" ] && break; sleep 0.05; done
[ -S "$sock" ] || { cat "$work/tenantvmd.log"; echo "demo: tenantvmd did not start" >&2; exit 1; }
head -n 1 "$work/tenantvmd.log"
export TENANTVM_SOCKET="$sock" TENANTVM_TOKEN_FILE="$state/admin.token"
tvm() { run "$bin/tenantvm" "$@"; }

bold "Creating tenant alice from a TOML spec"
cat >"$work/alice.toml" <<'TOML'
name = "alice"
vcpus = 1
memory_mib = 64
[image]
name = "hello"
[quotas]
requests_per_s = 5
TOML
cat "$work/alice.toml"
tvm create "$work/alice.toml" --token-out "$work/alice.token"

bold "Creating tenant bob from flags"
tvm create --name bob --image hello --memory-mib 32 --token-out "$work/bob.token"

bold "Both run, each as its own uid in its own cgroup"
tvm list
tvm status alice
# The tenant's cgroup is in this daemon's own subtree, which it names in its log at start.
subtree="$(sed -n 's/.*tenant cgroups subtree=\([^ ]*\).*/\1/p' "$work/tenantvmd.log" | head -n 1)"
limit="$(cat "/sys/fs/cgroup/memory/$subtree/alice/memory.limit_in_bytes" 2>/dev/null \
    || cat "/sys/fs/cgroup/$subtree/alice/memory.max" 2>/dev/null || true)"
if [ -n "$limit" ]; then
    echo "cgroup memory limit of alice ($subtree/alice): $limit bytes"
else
    echo "cgroup memory limit of alice: no memory cgroup found for $subtree/alice"
fi

bold "Logs: alice's serial console and lifecycle events"
# The guest calibrates its timer first (a few seconds here); wait for its first ticks.
for _ in $(seq 1 100); do
    "$bin/tenantvm" logs alice 2>/dev/null | grep -qE "tick 2|hello from" && break
    sleep 0.2
done
tvm logs alice --tail 8
tvm logs alice --stream events --tail 5

bold "Alice's own token sees alice only"
run "$bin/tenantvm" --token-file "$work/alice.token" list
run "$bin/tenantvm" --token-file "$work/alice.token" status bob || echo "(exit $?: bob is invisible to alice)"

bold "Destroying bob"
tvm destroy bob

bold "Bob's departure receipt, and the signed audit log's chain"
tvm receipt show bob
tvm receipt verify --log "$state/audit/receipts.jsonl" --public-key "$state/audit/receipt-signing.key.pub"

bold "A GPU tenant on the SIMULATED GPU host (no GPU is touched; the receipt says simulated)"
cat >"$work/dave.toml" <<'TOML'
name = "dave"
memory_mib = 32
# The same fields as a `tenantvm plan` tenants file: sized by the planner.
gpu = { model = "llama-3-8b", context = 8192, concurrency = 4 }
[image]
name = "hello"
TOML
cat "$work/dave.toml"
run "$bin/tenantvm" plan --tenants <(printf '[[tenants]]\nname = "dave"\nmodel = "llama-3-8b"\ncontext = 8192\nconcurrency = 4\n') \
    --gpu-backend "sim:$work/sim-gpus.json" || true
tvm create "$work/dave.toml" --token-out "$work/dave.token"
tvm status dave
bold "A share of a GPU that cannot be shared is refused, with the reason"
cp tests/fixtures/hosts/sim-whole-only.json "$work/sim-whole-only.json"
run "$bin/tenantvm" plan --tenants <(printf '[[tenants]]\nname = "x"\nprofile = "1g.10gb"\n') \
    --gpu-backend "sim:$work/sim-whole-only.json" || echo "(refused: exit $?)"
bold "Dave departs: device reset and scrub (simulated), instance destroyed, placement released"
tvm destroy dave
tvm receipt show dave

bold "What is left"
tvm list

bold "Destroying alice and stopping the daemon"
tvm destroy alice
kill -TERM "$daemon_pid"
wait "$daemon_pid" || true
daemon_pid=""
tail -n 1 "$work/tenantvmd.log"

# A Linux guest tenant: the guest image set (stock kernel + initramfs whose PID 1 is the
# tenantvm agent + a small CPU inference server) under QEMU software emulation, with an
# encrypted disk the agent unlocks with the key tenantvmd delivers over its channel.
linux_image="$root/target/guest-image-test"
bold "Linux guest: the guest image set (guest-image/build.sh)"
if [ -f "$linux_image/manifest.json" ] || SOURCE_DATE_EPOCH=1700000000 guest-image/build.sh "$linux_image"; then
    mkdir -p "$work/images/linux"
    cp "$linux_image"/{vmlinuz,initramfs.cpio.gz,cmdline,manifest.json} "$work/images/linux/"
    state="$work/state-linux"
    sock="$work/tenantvmd-linux.sock"
    bold "Starting a second tenantvmd with --backend qemu-tcg (state in $state)"
    "$bin/tenantvmd" --state-dir "$state" --socket "$sock" --image-dir "$work/images" \
        --backend qemu-tcg --keyslot-cost test --kek-file "$work/host-kek" --vcpu-overcommit 4 \
        >"$work/tenantvmd-linux.log" 2>&1 &
    daemon_pid=$!
    for _ in $(seq 1 200); do [ -S "$sock" ] && break; sleep 0.05; done
    [ -S "$sock" ] || { cat "$work/tenantvmd-linux.log"; echo "demo: tenantvmd did not start" >&2; exit 1; }
    export TENANTVM_SOCKET="$sock" TENANTVM_TOKEN_FILE="$state/admin.token"
    cat >"$work/carol.toml" <<'TOML'
name = "carol"
vcpus = 1
memory_mib = 512
disk_gib = 1
[image]
name = "linux"
[quotas]
requests_per_s = 1
max_concurrency = 1
TOML
    cat "$work/carol.toml"
    bold "Creating carol: boot, agent, key delivery, unlock + mount, payload ready (software emulation: about a minute)"
    start_s=$(date +%s)
    tvm create "$work/carol.toml" --token-out "$work/carol.token" --timeout-s 900
    echo "create to payload ready: $(( $(date +%s) - start_s )) s"
    bold "Inference with carol's own token"
    run "$bin/tenantvm" --token-file "$work/carol.token" infer carol "four score and seven years" --max-tokens 12
    bold "A second request right away: carol's quota is 1 request per second (over it: 429, exit status 13)"
    if run "$bin/tenantvm" --token-file "$work/carol.token" infer carol "we hold these truths" --max-tokens 4; then
        echo "(admitted: the first request took over a second, so carol's token was back)"
    else
        echo "(refused with exit status $?, as the quota says; nothing reached the guest)"
    fi
    bold "Destroying carol: agent shutdown (disk closed), crypto-shred, receipt"
    tvm destroy carol
    tvm receipt show carol
    # A real engine: llama.cpp's llama-server from Debian, in its own root inside the guest
    # (guest-image/variants/llama-cpp, built with the test model by its prepare.sh).
    llama_image="$root/.cache/guest-image-llama-cpp"
    llama_model="$root/.cache/llama-cpp/test-model.gguf"
    if [ -f "$llama_image/manifest.json" ] && [ -f "$llama_model" ]; then
        mkdir -p "$work/images/llama"
        cp "$llama_image"/{vmlinuz,initramfs.cpio.gz,cmdline,manifest.json} "$work/images/llama/"
        printf 'name = "dora"\nvcpus = 1\nmemory_mib = 1024\ndisk_gib = 1\n[image]\nname = "llama"\n' >"$work/dora.toml"
        bold "Creating dora: llama.cpp's llama-server ($(python3 -c 'import json,sys; print(json.load(open(sys.argv[1]))["payload"]["engine"]["version"])' "$llama_image/manifest.json")), confined in its own root, no model yet"
        tvm create "$work/dora.toml" --token-out "$work/dora.token" --timeout-s 900
        bold "Pushing a model onto dora's encrypted disk, then restarting its engine to serve it"
        run "$bin/tenantvm" --token-file "$work/dora.token" model push dora "$llama_model" --name tiny-llama
        run "$bin/tenantvm" --token-file "$work/dora.token" payload restart dora
        bold "A completion from llama-server (the test model's weights are random: its text is noise)"
        run "$bin/tenantvm" --token-file "$work/dora.token" infer dora "four score and seven years" --max-tokens 12
        bold "Destroying dora: the receipt covers the pushed model"
        tvm destroy dora
        tvm receipt show dora
    else
        echo "demo: skipping the llama.cpp tenant: its image set or test model is not built (run guest-image/variants/llama-cpp/prepare.sh)" >&2
    fi
    kill -TERM "$daemon_pid"
    wait "$daemon_pid" || true
    daemon_pid=""
else
    echo "demo: the guest image did not build (see above; scripts/setup.sh installs its tools); skipping the Linux guest" >&2
fi
echo
echo "demo: done"
