#!/usr/bin/env bash
# Benchmarks tenantvm-vmm against QEMU (-M microvm -accel kvm) on the same payloads, in the
# same run, and prints the ratios (docs/benchmarks.md records measured figures):
#   1. the test guest (tvm-testguest: one ELF with a PVH note, so QEMU's -kernel boots the
#      very same file): time from process start to the first serial byte and to the guest's
#      power-off, over BENCH_RUNS runs (default 10);
#   2. the VMM's own resident memory beyond guest RAM, for a 1-vCPU, 128 MiB guest that is
#      running (the test guest's `idle` test): VmRSS minus the Rss of the guest RAM mapping,
#      read from /proc/PID/smaps;
#   3. the stock Debian kernel (.cache/kernel/vmlinux, fetched by scripts/setup.sh) to its
#      first serial line ("Linux version"), BENCH_KERNEL_RUNS runs (default 2). Reported
#      separately: here the guest's own speed under this machine's nested hypervisor dominates.
#
# usage: scripts/bench.sh            (builds tenantvm-vmm --release and the test guests first)
# env:   BENCH_RUNS, BENCH_KERNEL_RUNS, BENCH_SKIP_KERNEL=1, QEMU (default qemu-system-x86_64)
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"

[ -r /dev/kvm ] && [ -w /dev/kvm ] || { echo "bench: /dev/kvm is not usable here" >&2; exit 1; }
qemu="${QEMU:-qemu-system-x86_64}"
command -v "$qemu" >/dev/null || { echo "bench: $qemu missing; run scripts/setup.sh" >&2; exit 1; }

cargo build --release --quiet -p tenantvm-vmm
scripts/build-test-guests.sh

export BENCH_VMM="$root/target/release/tenantvm-vmm"
export BENCH_GUEST="$root/target/test-guests/tvm-testguest"
export BENCH_KERNEL="$root/.cache/kernel/vmlinux"
export BENCH_QEMU="$qemu"

exec python3 - <<'PY'
import os, select, statistics, subprocess, sys, time

VMM = os.environ["BENCH_VMM"]
GUEST = os.environ["BENCH_GUEST"]
KERNEL = os.environ["BENCH_KERNEL"]
QEMU = os.environ["BENCH_QEMU"]
RUNS = int(os.environ.get("BENCH_RUNS", "10"))
KERNEL_RUNS = int(os.environ.get("BENCH_KERNEL_RUNS", "2"))
MEM_MIB = 128


def tenantvm_cmd(kernel, cmdline, extra=()):
    return [VMM, "--kernel", kernel, "--cmdline", cmdline, "--memory-mib", str(MEM_MIB),
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


print(f"tenantvm-vmm: {VMM}\nqemu: {QEMU} -M microvm\npayload: {GUEST} (PVH ELF), {MEM_MIB} MiB, 1 vCPU, {RUNS} runs each\n")
results = {}
for name, cmd in (("tenantvm-vmm", tenantvm_cmd(GUEST, "tvm.test=poweroff")),
                  ("qemu-microvm", qemu_cmd(GUEST, "tvm.test=poweroff"))):
    timed_run(cmd)  # warm the page cache
    firsts, ends = [], []
    for _ in range(RUNS):
        f, e = timed_run(cmd)
        firsts.append(f); ends.append(e)
    results[name] = (summary(firsts), summary(ends))

print(f"{'test guest':14} {'first serial byte (median/min/max)':>44}   {'power-off (median/min/max)':>40}")
for name, (f, e) in results.items():
    print(f"{name:14} {fmt_ms(f[0])} {fmt_ms(f[1])} {fmt_ms(f[2])}    {fmt_ms(e[0])} {fmt_ms(e[1])} {fmt_ms(e[2])}")
t, q = results["tenantvm-vmm"], results["qemu-microvm"]
print(f"ratio qemu/tenantvm: first byte {q[0][0] / t[0][0]:.2f}x, power-off {q[1][0] / t[1][0]:.2f}x (goal: >= 5x to the first byte)\n")

print("resident memory beyond guest RAM (idle 1-vCPU 128 MiB guest)")
mem = {}
for name, cmd in (("tenantvm-vmm", tenantvm_cmd(GUEST, "tvm.test=idle")),
                  ("qemu-microvm", qemu_cmd(GUEST, "tvm.test=idle"))):
    total, guest, rest = rss_of(cmd)
    mem[name] = rest
    print(f"{name:14} VmRSS {total / 2**20:7.2f} MiB, guest RAM resident {guest / 2**20:7.2f} MiB, VMM overhead {rest / 2**20:7.2f} MiB")
print(f"ratio qemu/tenantvm overhead: {mem['qemu-microvm'] / mem['tenantvm-vmm']:.2f}x (goal: tenantvm under 5 MiB)\n")

if os.environ.get("BENCH_SKIP_KERNEL") == "1":
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
