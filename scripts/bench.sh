#!/usr/bin/env bash
# Benchmarks tenantvm-vmm against QEMU (-M microvm -accel kvm) on the same payloads, in the
# same run, and prints the ratios (docs/benchmarks.md records measured figures):
#   1. the test guest (tvm-testguest: one ELF with a PVH note, so QEMU's -kernel boots the
#      very same file): time from process start to the first serial byte and to the guest's
#      power-off, over BENCH_RUNS runs (default 10);
#   2. the VMM's own resident memory beyond guest RAM, for a 1-vCPU, 128 MiB guest that is
#      running (the test guest's `idle` test): VmRSS minus the Rss of the guest RAM mapping,
#      read from /proc/PID/smaps;
#   3. devices (test guest's virtio driver, through KVM exits, ioeventfds and MSI-X):
#      virtio-blk sequential and random reads and writes with 4 KiB and 1 MiB requests
#      against the same file read/written directly on the host in the same run (dd for
#      sequential, pread/pwrite for random; both through the page cache), as a ratio;
#      virtio-vsock echo round-trip latency and throughput through the hybrid Unix socket;
#   4. the stock Debian kernel (.cache/kernel/vmlinux, fetched by scripts/setup.sh) to its
#      first serial line ("Linux version"), BENCH_KERNEL_RUNS runs (default 2). Reported
#      separately: here the guest's own speed under this machine's nested hypervisor dominates.
#   5. the nested host (tests/nested-host, docs/testing.md), with release binaries: the outer
#      guest from QEMU's start to its init, BENCH_NESTED_RUNS runs (default 3) for each root
#      format (ext4, initramfs); inside it, in one boot, the stock kernel to userspace under
#      tenantvm-vmm and under qemu-system-x86_64 -M microvm -accel kvm on the same kernel and
#      initramfs (3 runs each, the ratio), and the guest image to the agent's first answer.
#
# usage: scripts/bench.sh            (builds tenantvm-vmm --release and the test guests first)
# env:   BENCH_RUNS, BENCH_KERNEL_RUNS, BENCH_SKIP_KERNEL=1, BENCH_SKIP_DEVICES=1,
#        BENCH_DISK_MIB (default 512, well past the CPU caches, so neither side reads
#        its data from L3; 4 KiB workloads use a quarter), BENCH_QD (default 8),
#        BENCH_BLK_RUNS (default 3; medians), BENCH_BLK_NOTIFY (event_idx, the
#        default and what Linux negotiates; flags; poll),
#        BENCH_ONLY_DEVICES=1, BENCH_ONLY_STARTUP=1 (part 1 only), BENCH_SKIP_NESTED=1,
#        BENCH_ONLY_NESTED=1, BENCH_NESTED_RUNS,
#        BENCH_VMM_BASELINE=PATH (a second tenantvm-vmm binary, e.g. a build of an older
#        commit, timed in part 1 in the same interleaved run: a before/after A/B),
#        QEMU (default qemu-system-x86_64)
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"

qemu="${QEMU:-qemu-system-x86_64}"
command -v "$qemu" >/dev/null || { echo "bench: $qemu missing; run scripts/setup.sh" >&2; exit 1; }

# 5. The nested host: after the others, or alone with BENCH_ONLY_NESTED=1.
nested_bench() {
    [ "${BENCH_SKIP_NESTED:-0}" = 1 ] && { echo "nested host: skipped (BENCH_SKIP_NESTED=1)"; return 0; }
    local runs="${BENCH_NESTED_RUNS:-3}" nh=target/debug/nested-host
    local inputs=target/nested-host/release/inputs
    tests/nested-host/prepare.sh --profile release
    cargo build --quiet -p tenantvm-nested-host --bin nested-host
    echo
    echo "nested host: outer guest (QEMU TCG, q35, -cpu max, 1 vCPU, 3 GiB) from QEMU's start to its init ready, $runs runs per root format"
    local fmt i t times
    for fmt in ext4 initramfs; do
        times=()
        for i in $(seq "$runs"); do
            t="$("$nh" run --inputs "$inputs" --format "$fmt" platform 2>/dev/null |
                sed -n 's/.* \([0-9.]*\) s after the start.*/\1/p')"
            [ -n "$t" ] || { echo "bench: the outer guest did not boot ($fmt)" >&2; return 1; }
            times+=("$t")
        done
        printf '%-10s median %s s (runs: %s)\n' "$fmt" \
            "$(printf '%s\n' "${times[@]}" | sort -n | sed -n "$(( (runs + 1) / 2 ))p")" "${times[*]}"
    done
    echo "inside the outer guest (release binaries; one boot):"
    "$nh" run --inputs "$inputs" bench-stock-kernel bench-guest-image 2>/dev/null |
        sed -n 's/^NOTE [a-z-]*: /  /p; /^FAIL/p'
}
if [ "${BENCH_ONLY_NESTED:-0}" = 1 ]; then
    nested_bench
    exit
fi

[ -r /dev/kvm ] && [ -w /dev/kvm ] || { echo "bench: /dev/kvm is not usable here" >&2; exit 1; }

cargo build --release --quiet -p tenantvm-vmm
scripts/build-test-guests.sh

export BENCH_VMM="$root/target/release/tenantvm-vmm"
export BENCH_GUEST="$root/target/test-guests/tvm-testguest"
export BENCH_KERNEL="$root/.cache/kernel/vmlinux"
export BENCH_QEMU="$qemu"
if [ -n "${BENCH_VMM_BASELINE:-}" ]; then
    [ -x "$BENCH_VMM_BASELINE" ] || { echo "bench: BENCH_VMM_BASELINE=$BENCH_VMM_BASELINE is not an executable" >&2; exit 1; }
    BENCH_VMM_BASELINE="$(realpath "$BENCH_VMM_BASELINE")"
    export BENCH_VMM_BASELINE
fi

python3 - <<'PY'
import os, random, select, socket, statistics, subprocess, sys, tempfile, time

VMM = os.environ["BENCH_VMM"]
GUEST = os.environ["BENCH_GUEST"]
KERNEL = os.environ["BENCH_KERNEL"]
QEMU = os.environ["BENCH_QEMU"]
RUNS = int(os.environ.get("BENCH_RUNS", "10"))
KERNEL_RUNS = int(os.environ.get("BENCH_KERNEL_RUNS", "2"))
BASELINE = os.environ.get("BENCH_VMM_BASELINE") or None
MEM_MIB = 128


def tenantvm_cmd(kernel, cmdline, extra=(), vmm=VMM):
    return [vmm, "--kernel", kernel, "--cmdline", cmdline, "--memory-mib", str(MEM_MIB),
            "--vcpus", "1", "--serial", "stdout", *extra]


def qemu_cmd(kernel, cmdline):
    # -nodefaults: no default NIC/VGA/etc.; isa-debug-exit lets the test guest power QEMU off
    # (microvm has no ACPI sleep control port at 0x600; the guest writes 0xf4 next).
    return [QEMU, "-M", "microvm", "-accel", "kvm", "-m", str(MEM_MIB), "-smp", "1",
            "-nodefaults", "-no-user-config", "-display", "none", "-serial", "stdio",
            "-no-reboot", "-device", "isa-debug-exit,iobase=0xf4,iosize=1",
            "-kernel", kernel, "-append", cmdline]


def timed_run(cmd, until=None, timeout=120):
    """Runs cmd; returns (seconds to first stdout byte, seconds to `until` text or exit)."""
    start = time.perf_counter()
    p = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                         stderr=subprocess.DEVNULL)
    first = None
    seen = b""
    fd = p.stdout.fileno()
    end = None
    while True:
        left = timeout - (time.perf_counter() - start)
        if left <= 0:
            p.kill(); p.wait()
            raise RuntimeError(f"timed out after {timeout}s: {' '.join(cmd)}\n{seen[-2000:]!r}")
        r, _, _ = select.select([fd], [], [], min(left, 1.0))
        if not r:
            continue
        chunk = os.read(fd, 65536)
        now = time.perf_counter()
        if not chunk:
            break
        if first is None:
            first = now - start
        seen += chunk
        if until is not None and until in seen:
            end = now - start
            p.kill()
            break
    p.wait()
    if end is None:
        end = time.perf_counter() - start
    if first is None:
        raise RuntimeError(f"no serial output from: {' '.join(cmd)}")
    if until is None and b"TVMTEST poweroff PASS" not in seen:
        raise RuntimeError(f"guest did not report: {' '.join(cmd)}\n{seen[-2000:]!r}")
    return first, end


def smaps_overhead(pid, guest_bytes):
    """(VmRSS, Rss of the guest RAM mapping, the rest) in bytes, from /proc/pid/smaps."""
    total = guest = 0
    size = 0
    with open(f"/proc/{pid}/smaps") as f:
        for line in f:
            head = line.split()
            if "-" in head[0] and len(head) >= 5 and not head[0].endswith(":"):
                lo, hi = (int(x, 16) for x in head[0].split("-"))
                size = hi - lo
            elif head[0] == "Rss:":
                rss = int(head[1]) * 1024
                total += rss
                if size >= guest_bytes:
                    guest += rss
    return total, guest, total - guest


def rss_of(cmd):
    p = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                         stderr=subprocess.DEVNULL)
    seen = b""
    deadline = time.time() + 60
    while b"tick 3" not in seen:
        if time.time() > deadline:
            p.kill(); p.wait()
            raise RuntimeError(f"idle guest did not tick: {seen[-500:]!r}")
        r, _, _ = select.select([p.stdout], [], [], 1.0)
        if r:
            chunk = os.read(p.stdout.fileno(), 65536)
            if not chunk:
                break
            seen += chunk
    try:
        return smaps_overhead(p.pid, MEM_MIB << 20)
    finally:
        p.kill(); p.wait()


def summary(samples):
    return statistics.median(samples), min(samples), max(samples)


def fmt_ms(s):
    return f"{s * 1000:8.1f} ms"


ONLY_DEVICES = os.environ.get("BENCH_ONLY_DEVICES") == "1"
ONLY_STARTUP = os.environ.get("BENCH_ONLY_STARTUP") == "1"
print(f"tenantvm-vmm: {VMM}\nqemu: {QEMU} -M microvm\npayload: {GUEST} (PVH ELF), {MEM_MIB} MiB, 1 vCPU, {RUNS} runs each\n")
if not ONLY_DEVICES:
    peers = [("tenantvm-vmm", tenantvm_cmd(GUEST, "tvm.test=poweroff"))]
    if BASELINE:
        print(f"baseline: {BASELINE}\n")
        peers.append(("tenantvm-base", tenantvm_cmd(GUEST, "tvm.test=poweroff", vmm=BASELINE)))
    peers.append(("qemu-microvm", qemu_cmd(GUEST, "tvm.test=poweroff")))
    for _, cmd in peers:
        timed_run(cmd)  # warm the page cache
    # Interleaved (one run of each in turn), so that load from other work on the machine
    # falls on every peer alike.
    samples = {name: ([], []) for name, _ in peers}
    for _ in range(RUNS):
        for name, cmd in peers:
            f, e = timed_run(cmd)
            samples[name][0].append(f); samples[name][1].append(e)
    results = {name: (summary(f), summary(e)) for name, (f, e) in samples.items()}

    print(f"{'test guest':14} {'first serial byte (median/min/max)':>44}   {'power-off (median/min/max)':>40}")
    for name, (f, e) in results.items():
        print(f"{name:14} {fmt_ms(f[0])} {fmt_ms(f[1])} {fmt_ms(f[2])}    {fmt_ms(e[0])} {fmt_ms(e[1])} {fmt_ms(e[2])}")
    q = results["qemu-microvm"]
    for name in [n for n, _ in peers if n != "qemu-microvm"]:
        t = results[name]
        print(f"ratio qemu/{name}: first byte {q[0][0] / t[0][0]:.2f}x, power-off {q[1][0] / t[1][0]:.2f}x (goal: >= 5x to the first byte)")
    print()

if ONLY_STARTUP:
    sys.exit(0)
if not ONLY_DEVICES:
    print("resident memory beyond guest RAM (idle 1-vCPU 128 MiB guest)")
    mem = {}
    for name, cmd in (("tenantvm-vmm", tenantvm_cmd(GUEST, "tvm.test=idle")),
                      ("qemu-microvm", qemu_cmd(GUEST, "tvm.test=idle"))):
        total, guest, rest = rss_of(cmd)
        mem[name] = rest
        print(f"{name:14} VmRSS {total / 2**20:7.2f} MiB, guest RAM resident {guest / 2**20:7.2f} MiB, VMM overhead {rest / 2**20:7.2f} MiB")
    print(f"ratio qemu/tenantvm overhead: {mem['qemu-microvm'] / mem['tenantvm-vmm']:.2f}x (goal: tenantvm under 5 MiB)\n")


def guest_phase(cmd, start_mark, end_mark, timeout=600, require=None):
    """Seconds between two serial markers of a guest run (the guest's own timing is
    unreliable under nested KVM; the host clock is not). With `require`, the run must
    also print that (its verdict, which may come after the end mark)."""
    p = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE)
    seen, t0, t1 = b"", None, None
    deadline = time.perf_counter() + timeout
    while t1 is None:
        if time.perf_counter() > deadline:
            p.kill(); p.wait()
            raise RuntimeError(f"timed out: {' '.join(cmd)}\n{seen[-2000:]!r}")
        r, _, _ = select.select([p.stdout], [], [], 1.0)
        if not r:
            continue
        chunk = os.read(p.stdout.fileno(), 65536)
        if not chunk:
            break
        seen += chunk
        now = time.perf_counter()
        if t0 is None and start_mark in seen:
            t0 = now
        if t0 is not None and end_mark in seen:
            t1 = now
    if require is not None:
        seen += p.stdout.read()
    p.wait()
    if t0 is None or t1 is None or (require is not None and require not in seen):
        raise RuntimeError(f"guest did not report: {' '.join(cmd)}\n{seen[-2000:]!r}\n{p.stderr.read()[-1000:]!r}")
    return t1 - t0


def host_dd(path, kind, bs, total):
    """Seconds for dd to read (to /dev/null) or write (from /dev/zero) the same range."""
    io = (["dd", f"if={path}", "of=/dev/null"] if kind == "seq-read"
          else ["dd", "if=/dev/zero", f"of={path}", "conv=notrunc"])
    start = time.perf_counter()
    subprocess.run(io + [f"bs={bs}", f"count={total // bs}"], check=True,
                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return time.perf_counter() - start


def host_direct(path, kind, bs, total, qd):
    """Seconds for the guest's I/O done directly on the host file: the same offsets, into
    or from `qd` rotating buffers (the guest's buffer footprint), preadv/pwritev."""
    count = total // bs
    fd = os.open(path, os.O_RDWR)
    try:
        blocks = os.fstat(fd).st_size // bs
        x = 0x9e3779b97f4a7c15
        offsets = []
        for i in range(count):
            if kind.startswith("rand"):
                x ^= (x << 13) & (2**64 - 1)
                x ^= x >> 7
                x ^= (x << 17) & (2**64 - 1)
                offsets.append((x % blocks) * bs)
            else:
                offsets.append(i * bs)
        bufs = [bytearray(os.urandom(bs)) for _ in range(qd)]
        io = os.preadv if kind.endswith("read") else os.pwritev
        start = time.perf_counter()
        for i, off in enumerate(offsets):
            io(fd, [bufs[i % qd]], off)
        return time.perf_counter() - start
    finally:
        os.close(fd)


def block_bench():
    mib = int(os.environ.get("BENCH_DISK_MIB", "512"))
    qd = int(os.environ.get("BENCH_QD", "8"))
    runs = int(os.environ.get("BENCH_BLK_RUNS", "3"))
    notify = os.environ.get("BENCH_BLK_NOTIFY", "event_idx")
    modes = {"event_idx": "tvm.event_idx=1 tvm.poll=0", "flags": "tvm.event_idx=0 tvm.poll=0",
             "poll": "tvm.event_idx=1 tvm.poll=1"}
    if notify not in modes:
        raise SystemExit(f"BENCH_BLK_NOTIFY={notify}: use one of {', '.join(modes)}")
    with tempfile.TemporaryDirectory() as tmp:
        disk = os.path.join(tmp, "disk.img")
        with open(disk, "wb") as f:
            for _ in range(2 * mib):
                f.write(os.urandom(1 << 20))
        print(f"virtio-blk: {mib} MiB per workload on a {2 * mib} MiB file (page cache, warm); "
              f"guest: queue depth {qd}, notifications by {notify}; host: preadv/pwritev of the "
              f"same offsets into {qd} rotating buffers, and dd; median of {runs} interleaved runs each")
        print(f"{'workload':20} {'guest MB/s':>10} {'guest IOPS':>10} {'host MB/s':>10} {'host IOPS':>10} {'ratio':>6} {'dd MB/s':>9}")
        for bs in (4096, 1 << 20):
            size = mib if bs > 4096 else max(mib // 4, 1)
            for kind in ("seq-read", "seq-write", "rand-read", "rand-write"):
                cmdline = (f"tvm.test=blk-bench tvm.bench={kind} tvm.bs={bs} tvm.mib={size} "
                           f"tvm.qd={qd} {modes[notify]}")
                cmd = tenantvm_cmd(GUEST, cmdline, ["--disk", f"path={disk}", "--rng", "off"])
                gs, hs, dds = [], [], []
                for _ in range(runs):
                    gs.append(guest_phase(cmd, b"TVMTEST blk-bench GO", b"TVMTEST blk-bench END",
                                          require=b"TVMTEST blk-bench PASS"))
                    hs.append(host_direct(disk, kind, bs, size << 20, qd))
                    if kind.startswith("seq"):
                        dds.append(host_dd(disk, kind, bs, size << 20))
                g, h = statistics.median(gs), statistics.median(hs)
                dd = f"{size * 1.048576 / statistics.median(dds):9.1f}" if dds else f"{'-':>9}"
                ops = (size << 20) // bs
                label = f"{kind} 4 KiB" if bs == 4096 else f"{kind} 1 MiB"
                print(f"{label:20} {size * 1.048576 / g:10.1f} {ops / g:10.0f} {size * 1.048576 / h:10.1f} {ops / h:10.0f} {h / g * 100:5.0f}% {dd}")
        print("goal: ratio >= 70% at 1 MiB\n")


def recv_exact(s, n):
    buf = bytearray()
    while len(buf) < n:
        chunk = s.recv(n - len(buf))
        if not chunk:
            raise RuntimeError("vsock echo closed early")
        buf += chunk
    return bytes(buf)


def vsock_bench():
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "v.sock")
        cmd = tenantvm_cmd(GUEST, "tvm.test=vsock-bench", ["--vsock", f"cid=3,socket={path}", "--rng", "off"])
        p = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                             stderr=subprocess.DEVNULL)
        seen = b""
        deadline = time.time() + 60
        while b"vsock-bench READY" not in seen:
            if time.time() > deadline:
                p.kill(); p.wait()
                raise RuntimeError(f"vsock-bench guest not ready: {seen[-500:]!r}")
            r, _, _ = select.select([p.stdout], [], [], 1.0)
            if r:
                seen += os.read(p.stdout.fileno(), 65536)
        s = socket.socket(socket.AF_UNIX)
        s.connect(path)
        s.sendall(b"CONNECT 1234\n")
        line = b""
        while not line.endswith(b"\n"):
            line += s.recv(1)
        rtts = []
        msg = b"x" * 64
        for _ in range(2000):
            t = time.perf_counter()
            s.sendall(msg)
            recv_exact(s, len(msg))
            rtts.append(time.perf_counter() - t)
        chunk = os.urandom(64 << 10)
        total = 64 << 20
        t = time.perf_counter()
        for _ in range(total // len(chunk)):
            s.sendall(chunk)
            if recv_exact(s, len(chunk)) != chunk:
                raise RuntimeError("vsock echo corrupted the data")
        elapsed = time.perf_counter() - t
        s.close()
        p.wait(timeout=60)
        rtts.sort()
        print("virtio-vsock echo (host Unix socket -> VMM -> guest driver -> back)")
        print(f"round trip, 64 B: median {statistics.median(rtts) * 1e6:.0f} us, p99 {rtts[int(len(rtts) * 0.99)] * 1e6:.0f} us ({len(rtts)} round trips)")
        print(f"throughput, 64 KiB windows: {total / elapsed / 1e6:.1f} MB/s each way ({total >> 20} MiB echoed)\n")


if os.environ.get("BENCH_SKIP_DEVICES") == "1":
    print("devices: skipped (BENCH_SKIP_DEVICES=1)\n")
else:
    block_bench()
    vsock_bench()

if ONLY_DEVICES:
    pass
elif os.environ.get("BENCH_SKIP_KERNEL") == "1":
    print("stock kernel: skipped (BENCH_SKIP_KERNEL=1)")
elif not os.path.exists(KERNEL):
    print(f"stock kernel: skipped ({KERNEL} missing; run scripts/setup.sh)")
else:
    print(f"stock kernel {KERNEL} to its first serial line ('Linux version'), {KERNEL_RUNS} runs each")
    kres = {}
    for name, cmd in (("tenantvm-vmm", tenantvm_cmd(KERNEL, "console=ttyS0 earlyprintk=ttyS0")),
                      ("qemu-microvm", qemu_cmd(KERNEL, "console=ttyS0 earlyprintk=ttyS0"))):
        lines = [timed_run(cmd, until=b"Linux version", timeout=300)[1] for _ in range(KERNEL_RUNS)]
        kres[name] = statistics.median(lines)
        print(f"{name:14} first line {fmt_ms(kres[name])} (median; runs: {', '.join(fmt_ms(x).strip() for x in lines)})")
    print(f"ratio qemu/tenantvm: {kres['qemu-microvm'] / kres['tenantvm-vmm']:.2f}x")
PY

if [ "${BENCH_ONLY_STARTUP:-0}" = 1 ] || [ "${BENCH_ONLY_DEVICES:-0}" = 1 ]; then
    exit 0
fi
nested_bench
