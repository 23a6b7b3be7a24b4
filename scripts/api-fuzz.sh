#!/usr/bin/env bash
# Runs Schemathesis (a property-based API fuzzer no one here wrote) against
# docs/api/openapi.yaml and a live tenantvmd in a temporary state directory: every check,
# examples generated from the spec (valid and not), and stateful runs that follow the spec's
# links from POST /v1/tenants to every route that takes a tenant's name. Bounded in examples
# and time; any finding fails the run (exit 1). The daemon serves its API on a Unix socket;
# a small proxy here gives Schemathesis a TCP address for it.
#
# Needs root and /dev/kvm (tenants run the idle guest under tenantvm-vmm) and Schemathesis
# (scripts/setup.sh --dev installs it into .cache/schemathesis). CI (.ci/run) runs it.
#
# usage: scripts/api-fuzz.sh
#   TENANTVM_API_FUZZ_EXAMPLES=N  examples per operation (default 20)
#   TENANTVM_API_FUZZ_SECONDS=N   time budget of the whole run (default 180)
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"

st="$root/.cache/schemathesis/bin/schemathesis"
if [ ! -x "$st" ]; then
    echo "api-fuzz: skipped: Schemathesis is not installed (scripts/setup.sh --dev)" >&2
    exit 0
fi
if [ "$(id -u)" -ne 0 ] || [ ! -w /dev/kvm ]; then
    echo "api-fuzz: skipped: needs root and /dev/kvm (tenants run a VM each)" >&2
    exit 0
fi
examples="${TENANTVM_API_FUZZ_EXAMPLES:-20}"
seconds="${TENANTVM_API_FUZZ_SECONDS:-180}"

cargo build -q -p tenantvm -p tenantvm-jail --bins -p tenantvm-vmm
bin="$root/target/debug"

# Short paths: the VMM's control socket path must fit in 108 bytes.
work="$(mktemp -d /tmp/tvmfz.XXXXXX)"
daemon_pid=""
proxy_pid=""
cleanup() {
    if [ -n "$daemon_pid" ]; then
        # Tenants the run left: destroyed, so no VM outlives it.
        for t in $("$bin/tenantvm" --socket "$work/d.sock" --token-file "$work/state/admin.token" list --json 2>/dev/null \
            | python3 -c 'import json,sys; print(" ".join(t["name"] for t in json.load(sys.stdin)["tenants"]))' 2>/dev/null); do
            "$bin/tenantvm" --socket "$work/d.sock" --token-file "$work/state/admin.token" destroy "$t" >/dev/null 2>&1 || true
        done
        kill "$daemon_pid" 2>/dev/null || true
        wait "$daemon_pid" 2>/dev/null || true
    fi
    [ -z "$proxy_pid" ] || kill "$proxy_pid" 2>/dev/null || true
    rm -rf "$work"
}
trap cleanup EXIT

mkdir -p "$work/img/hello"
python3 scripts/make-idle-guest.py "$work/img/hello/kernel" "hello from the idle guest"
echo "console=ttyS0" >"$work/img/hello/cmdline"
TENANTVMD_KEK_FILE="$work/host-kek" TENANTVMD_KEYSLOT_COST=test \
    "$bin/tenantvmd" --state-dir "$work/state" --socket "$work/d.sock" --image-dir "$work/img" \
    --vmm-binary "$bin/tenantvm-vmm" --uid-range 3900000:64 --vcpu-overcommit 32 \
    >"$work/tenantvmd.log" 2>&1 &
daemon_pid=$!
for _ in $(seq 1 200); do [ -S "$work/d.sock" ] && break; sleep 0.05; done
[ -S "$work/d.sock" ] || { cat "$work/tenantvmd.log"; echo "api-fuzz: tenantvmd did not start" >&2; exit 1; }

# TCP on a free loopback port -> the daemon's Unix socket, a connection each.
port="$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')"
python3 - "$port" "$work/d.sock" <<'PY' &
import socket, sys, threading

port, path = int(sys.argv[1]), sys.argv[2]

def handle(client):
    daemon = socket.socket(socket.AF_UNIX)
    daemon.connect(path)

    def up():
        sending = True
        while True:
            try:
                data = client.recv(65536)
            except OSError:
                return
            if not data:
                if sending:
                    try:
                        daemon.shutdown(socket.SHUT_WR)  # the client is done
                    except OSError:
                        pass
                return
            if sending:
                try:
                    daemon.sendall(data)
                except OSError:
                    # The daemon refused the rest of a body unread (413) and closed: its
                    # answer is still to be read; the client's bytes are read and dropped.
                    sending = False

    sender = threading.Thread(target=up, daemon=True)
    sender.start()
    while True:
        try:
            data = daemon.recv(65536)
            if not data:
                break
            client.sendall(data)
        except OSError:
            break
    # A lingering close, as a TCP server does: a client still sending a refused body reads
    # the answer instead of a reset (the sender keeps reading its bytes, for up to 5 s).
    try:
        client.shutdown(socket.SHUT_WR)
    except OSError:
        pass
    sender.join(5)
    client.close()
    daemon.close()

listener = socket.create_server(("127.0.0.1", port))
while True:
    conn, _ = listener.accept()
    threading.Thread(target=handle, args=(conn,), daemon=True).start()
PY
proxy_pid=$!
for _ in $(seq 1 100); do
    python3 -c "import socket; socket.create_connection(('127.0.0.1', $port), 1)" 2>/dev/null && break
    sleep 0.05
done

token="$(cat "$work/state/admin.token")"
set +e
# From the temporary directory: Schemathesis keeps a cache in its working directory.
(cd "$work" && "$st" --config-file "$root/scripts/api-fuzz.toml" run "$root/docs/api/openapi.yaml" --url "http://127.0.0.1:$port" \
    --header "Authorization: Bearer $token" \
    --checks all --max-examples "$examples" --max-time "$seconds" \
    --workers 1 --seed 1 --no-color --generation-database none)
rc=$?
set -e
if [ "$rc" -ne 0 ]; then
    echo "api-fuzz: Schemathesis found disagreements between docs/api/openapi.yaml and the server (above); daemon log tail:" >&2
    tail -n 20 "$work/tenantvmd.log" >&2
    exit 1
fi
echo "api-fuzz: no finding"
