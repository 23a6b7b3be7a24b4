#!/usr/bin/env bash
# A real Kubernetes API server on loopback, for the Kubernetes tier's tests and benchmark
# (orchestrator/kube, docs/kubernetes.md). No registry ships a kube-apiserver binary, so this
# builds one from Debian bookworm's `kubernetes` source package (1.20.2, vendored) with
# Debian's Go 1.19, once, into .cache/kube/ and this machine's ~/.cache/tenantvm/ (never
# committed; a rerun or another clone on the machine finds it and takes
# seconds), and runs it over Debian's etcd-server 3.4 with a throwaway CA and a token file.
#
# usage: scripts/kube-apiserver.sh build            # build (or find) the binary; prints its path
#        scripts/kube-apiserver.sh start DIR        # etcd + apiserver with their state in DIR
#        scripts/kube-apiserver.sh start-apiserver DIR   # the apiserver again, over DIR's etcd
#        scripts/kube-apiserver.sh stop-apiserver DIR    # the apiserver only (etcd keeps the data)
#        scripts/kube-apiserver.sh stop DIR         # both
#
# `start` leaves in DIR: `kubeconfig` (the admin: group system:masters), one
# `kubeconfig-NAME` per identity of the token file (operator, node-a..node-e, each in group
# tenantvm:NAME-kind), `server` (the URL), `ca.crt`, the pids and the logs. Ports are chosen
# free at start. Loopback only: 1.20 is past its end of life and must never face a network.
#
# Needs root for apt (the first build installs golang-1.19-go, rsync, etcd-server and
# Debian's reflect2 sources). The source is fetched with a private apt configuration under
# .cache/kube/apt (a deb-src line of its own), so the system's sources are never edited.
set -euo pipefail

root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cache="$root/.cache/kube"
bin="$cache/bin/kube-apiserver"
# The build takes half an hour on two cores: a copy is kept per machine too (like cargo's
# registry cache), so a fresh clone on the same machine (CI's) finds it in seconds.
machine_copy="${TENANTVM_MACHINE_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/tenantvm}/kube-apiserver-1.20.2-bookworm"
say() { printf '\033[1mkube-apiserver:\033[0m %s\n' "$*" >&2; }

sudo_cmd=()
if [ "$(id -u)" -ne 0 ]; then sudo_cmd=(sudo); fi

install_packages() {
    local missing=()
    for p in "$@"; do
        dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
    done
    if [ "${#missing[@]}" -gt 0 ]; then
        say "installing ${missing[*]}"
        "${sudo_cmd[@]}" apt-get update -qq
        DEBIAN_FRONTEND=noninteractive "${sudo_cmd[@]}" apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
    fi
}

keep_machine_copy() {
    [ -x "$machine_copy" ] && return
    mkdir -p "$(dirname "$machine_copy")" &&
        cp "$bin" "$machine_copy.tmp.$$" && mv "$machine_copy.tmp.$$" "$machine_copy" ||
        say "could not keep a copy at $machine_copy (the next clone builds again)"
}

build() {
    # What running it needs, whether the binary is cached or not.
    install_packages etcd-server openssl curl python3
    if [ ! -x "$bin" ] && [ -x "$machine_copy" ]; then
        say "found this machine's copy: $machine_copy"
        mkdir -p "$cache/bin"
        cp "$machine_copy" "$bin.tmp" && mv "$bin.tmp" "$bin"
    fi
    if [ -x "$bin" ]; then
        keep_machine_copy
        echo "$bin"
        return
    fi
    local started=$SECONDS
    install_packages golang-1.19-go rsync golang-github-modern-go-reflect2-dev dpkg-dev
    local src="$cache/src" apt="$cache/apt"
    rm -rf "$src" && mkdir -p "$src" "$apt/lists/partial" "$apt/archives/partial"
    # A deb-src line of our own: the system's sources stay as they are.
    printf 'deb-src [signed-by=/usr/share/keyrings/debian-archive-keyring.gpg] http://deb.debian.org/debian bookworm main\n' >"$apt/sources.list"
    local opts=(-o "Dir::Etc::sourcelist=$apt/sources.list" -o "Dir::Etc::sourceparts=-"
        -o "Dir::State::Lists=$apt/lists" -o "Dir::Cache::archives=$apt/archives"
        -o "APT::Sandbox::User=root" -qq)
    say "fetching the kubernetes source package (bookworm)"
    apt-get "${opts[@]}" update
    (cd "$src" && apt-get "${opts[@]}" source kubernetes >/dev/null)
    local tree
    tree="$(find "$src" -maxdepth 1 -mindepth 1 -type d -name 'kubernetes-*' | head -n 1)"
    [ -n "$tree" ] || { echo "kube-apiserver: no kubernetes-* tree under $src" >&2; exit 1; }
    # The vendored reflect2 1.0.1 crashes the server at the first custom-resource create
    # under Go 1.18+: Debian's 1.0.2 sources replace it.
    local reflect2=/usr/share/gocode/src/github.com/modern-go/reflect2
    [ -d "$reflect2" ] || { echo "kube-apiserver: $reflect2 missing (golang-github-modern-go-reflect2-dev)" >&2; exit 1; }
    rm -rf "$tree/vendor/github.com/modern-go/reflect2"
    cp -r "$reflect2" "$tree/vendor/github.com/modern-go/reflect2"
    sed -i 's|^# github.com/modern-go/reflect2 v1.0.1$|# github.com/modern-go/reflect2 v1.0.2|' "$tree/vendor/modules.txt"
    sed -i 's|github.com/modern-go/reflect2 v1.0.1|github.com/modern-go/reflect2 v1.0.2|' "$tree/go.mod"
    local gopath="$cache/gopath"
    rm -rf "$gopath" && mkdir -p "$gopath/src/k8s.io"
    ln -s "$tree" "$gopath/src/k8s.io/kubernetes"
    say "building cmd/kube-apiserver with Go 1.19 (a few minutes)"
    (cd "$gopath/src/k8s.io/kubernetes" &&
        PATH="/usr/lib/go-1.19/bin:$PATH" GOPATH="$gopath" GOCACHE="$cache/gocache" \
            GOFLAGS=-mod=vendor GOPROXY=off GO111MODULE=on CGO_ENABLED=0 \
            KUBE_GIT_VERSION="v1.20.2-debian" \
            nice -n 10 make WHAT=cmd/kube-apiserver >"$cache/build.log" 2>&1) || {
        tail -n 40 "$cache/build.log" >&2
        exit 1
    }
    local built
    built="$(find "$tree/_output" -type f -name kube-apiserver -perm -u+x | head -n 1)"
    [ -n "$built" ] || { echo "kube-apiserver: the build made no binary (see $cache/build.log)" >&2; exit 1; }
    mkdir -p "$cache/bin"
    cp "$built" "$bin.tmp" && mv "$bin.tmp" "$bin"
    # The tree and Go's cache are large; the binary is all we keep.
    rm -rf "$src" "$gopath" "$cache/gocache" "$apt"
    keep_machine_copy
    say "built in $((SECONDS - started)) s: $bin"
    echo "$bin"
}

free_port() {
    python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'
}

# Identities of the token file: name, groups. The admin is a system:masters member; the
# others get only what the RBAC manifests (orchestrator/kube/deploy/rbac.yaml) bind.
identities() {
    echo "admin system:masters"
    echo "operator tenantvm:operators"
    for n in a b c d e; do echo "node-$n tenantvm:nodes"; done
}

write_kubeconfig() { # DIR FILE USER TOKEN
    cat >"$2" <<EOF
apiVersion: v1
kind: Config
clusters:
- name: local
  cluster:
    server: $(cat "$1/server")
    certificate-authority: $1/ca.crt
users:
- name: $3
  user:
    token: $4
contexts:
- name: $3
  context:
    cluster: local
    user: $3
current-context: $3
EOF
}

wait_ready() { # DIR
    local dir="$1" i
    for i in $(seq 1 300); do
        if curl -fsS --cacert "$dir/ca.crt" -H "Authorization: Bearer $(cat "$dir/token-admin")" \
            "$(cat "$dir/server")/readyz" >/dev/null 2>&1; then
            return 0
        fi
        kill -0 "$(cat "$dir/apiserver.pid")" 2>/dev/null || {
            tail -n 30 "$dir/apiserver.log" >&2
            echo "kube-apiserver: the apiserver exited at start" >&2
            exit 1
        }
        sleep 0.2
    done
    tail -n 30 "$dir/apiserver.log" >&2
    echo "kube-apiserver: not ready after 60 s" >&2
    exit 1
}

start_apiserver() { # DIR
    local dir="$1"
    nice -n 5 "$bin" \
        --bind-address=127.0.0.1 --advertise-address=127.0.0.1 \
        --secure-port="$(cat "$dir/port")" \
        --etcd-servers="http://127.0.0.1:$(cat "$dir/etcd-port")" \
        --tls-cert-file="$dir/server.crt" --tls-private-key-file="$dir/server.key" \
        --client-ca-file="$dir/ca.crt" \
        --token-auth-file="$dir/tokens.csv" \
        --authorization-mode=RBAC \
        --service-account-issuer=https://kubernetes.default.svc \
        --service-account-key-file="$dir/sa.pub" \
        --service-account-signing-key-file="$dir/sa.key" \
        --api-audiences=https://kubernetes.default.svc \
        --service-cluster-ip-range=10.96.0.0/16 \
        --enable-admission-plugins=NamespaceLifecycle \
        --disable-admission-plugins=ServiceAccount \
        --allow-privileged=false --profiling=false \
        --event-ttl=1h \
        >>"$dir/apiserver.log" 2>&1 &
    echo $! >"$dir/apiserver.pid"
    wait_ready "$dir"
}

start() { # DIR
    local dir="$1"
    build >/dev/null
    mkdir -p "$dir"
    dir="$(cd "$dir" && pwd)"
    # Throwaway CA and serving certificate for 127.0.0.1; service-account signing key.
    (cd "$dir" &&
        openssl req -x509 -newkey rsa:2048 -nodes -days 2 -subj /CN=tenantvm-test-ca \
            -keyout ca.key -out ca.crt 2>/dev/null &&
        openssl req -newkey rsa:2048 -nodes -subj /CN=kube-apiserver \
            -keyout server.key -out server.csr 2>/dev/null &&
        printf 'subjectAltName=IP:127.0.0.1,DNS:localhost\n' >san.ext &&
        openssl x509 -req -in server.csr -CA ca.crt -CAkey ca.key -CAcreateserial -days 2 \
            -extfile san.ext -out server.crt 2>/dev/null &&
        openssl genrsa -out sa.key 2048 2>/dev/null &&
        openssl rsa -in sa.key -pubout -out sa.pub 2>/dev/null)
    : >"$dir/tokens.csv"
    local name groups token
    while read -r name groups; do
        token="$(head -c 24 /dev/urandom | od -An -tx1 | tr -d ' \n')"
        printf '%s\n' "$token" >"$dir/token-$name"
        printf '%s,%s,%s,"%s"\n' "$token" "$name" "$name" "$groups" >>"$dir/tokens.csv"
    done < <(identities)
    chmod 600 "$dir"/token-* "$dir/tokens.csv" "$dir"/*.key
    free_port >"$dir/port"
    free_port >"$dir/etcd-port"
    echo "https://127.0.0.1:$(cat "$dir/port")" >"$dir/server"
    local peer
    peer="$(free_port)"
    nice -n 5 etcd --data-dir "$dir/etcd" --name test \
        --listen-client-urls "http://127.0.0.1:$(cat "$dir/etcd-port")" \
        --advertise-client-urls "http://127.0.0.1:$(cat "$dir/etcd-port")" \
        --listen-peer-urls "http://127.0.0.1:$peer" \
        --initial-advertise-peer-urls "http://127.0.0.1:$peer" \
        --initial-cluster "test=http://127.0.0.1:$peer" \
        --unsafe-no-fsync >"$dir/etcd.log" 2>&1 &
    echo $! >"$dir/etcd.pid"
    start_apiserver "$dir"
    write_kubeconfig "$dir" "$dir/kubeconfig" admin "$(cat "$dir/token-admin")"
    while read -r name groups; do
        write_kubeconfig "$dir" "$dir/kubeconfig-$name" "$name" "$(cat "$dir/token-$name")"
    done < <(identities)
    say "ready: $(cat "$dir/server") (KUBECONFIG=$dir/kubeconfig)"
}

stop_pid() { # FILE
    [ -f "$1" ] || return 0
    local pid
    pid="$(cat "$1")"
    if kill -0 "$pid" 2>/dev/null; then
        kill "$pid" 2>/dev/null || true
        for _ in $(seq 1 50); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
        kill -9 "$pid" 2>/dev/null || true
    fi
    rm -f "$1"
}

case "${1:-}" in
    build) build ;;
    start) [ -n "${2:-}" ] || { echo "usage: $0 start DIR" >&2; exit 2; }; start "$2" ;;
    start-apiserver) [ -n "${2:-}" ] || exit 2; start_apiserver "$(cd "$2" && pwd)" ;;
    stop-apiserver) [ -n "${2:-}" ] || exit 2; stop_pid "$2/apiserver.pid" ;;
    stop) [ -n "${2:-}" ] || exit 2; stop_pid "$2/apiserver.pid"; stop_pid "$2/etcd.pid" ;;
    *) sed -n '2,20p' "$0" >&2; exit 2 ;;
esac
