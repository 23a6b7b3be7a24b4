#!/usr/bin/env bash
# Passthrough benchmarks on the model GPU (a test build: --features test-model-gpu), in one
# run (docs/benchmarks.md, "Passthrough"):
#   1. what attaching a device with a 128 GiB BAR (memfd-backed, mapped as one KVM slot)
#      costs at start: the test guest (tvm.test=poweroff) to its first serial byte and to
#      power-off, with and without `--device model-gpu`, BENCH_RUNS runs each (default 20),
#      interleaved so load falls on both alike;
#   2. MSI-X round trips per second (tvm.test=vfio-irq-bench, BENCH_IRQS round trips,
#      default 20000: a trapped doorbell write, then the interrupt from the device's eventfd
#      through KVM's irqfd), and the VMM's wake-ups per interrupt: context switches of every
#      VMM thread except the vCPU between the guest's GO and END lines;
#   3. with BENCH_NESTED=1, in the nested host (tests/nested-host, its scenario
#      bench-vfio-edu): edu MSI round trips per second under tenantvm-vmm and under QEMU's
#      vfio-pci, the same test guest, three runs each in one boot.
#
# usage: scripts/bench-vfio.sh      env: BENCH_RUNS, BENCH_IRQS, BENCH_NESTED=1
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
[ -r /dev/kvm ] || { echo "bench-vfio: skipped: /dev/kvm is not usable here" >&2; exit 0; }
cargo build --release --quiet --features test-model-gpu -p tenantvm-vmm
scripts/build-test-guests.sh

python3 - <<'PY'
import os, statistics, subprocess, time

vmm = "target/release/tenantvm-vmm"
guest = "target/test-guests/tvm-testguest"
runs = int(os.environ.get("BENCH_RUNS", "20"))
irqs = int(os.environ.get("BENCH_IRQS", "20000"))

def start(extra, test, more=""):
    args = [vmm, "--kernel", guest, "--cmdline", f"console=ttyS0 tvm.test={test} {more}",
            "--serial", "stdout"] + extra
    return subprocess.Popen(args, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                            stderr=subprocess.DEVNULL)

def boot(extra):
    t0 = time.perf_counter()
    p = start(extra, "poweroff")
    p.stdout.read(1)
    first = time.perf_counter() - t0
    p.stdout.read()
    p.wait()
    if p.returncode != 0:
        raise SystemExit(f"bench-vfio: the guest exited {p.returncode} with {extra}")
    return first * 1000, (time.perf_counter() - t0) * 1000

results = {"without": [], "with model GPU": []}
for _ in range(runs):
    results["without"].append(boot([]))
    results["with model GPU"].append(boot(["--device", "model-gpu"]))
print(f"1. test guest, {runs} runs each: first serial byte / power-off, median (min-max) ms")
med = {}
for name, r in results.items():
    f = [x[0] for x in r]; o = [x[1] for x in r]
    med[name] = (statistics.median(f), statistics.median(o))
    print(f"   {name:15} {med[name][0]:7.1f} ({min(f):.1f}-{max(f):.1f})   "
          f"{med[name][1]:7.1f} ({min(o):.1f}-{max(o):.1f})")
print(f"   attach cost: +{med['with model GPU'][0] - med['without'][0]:.1f} ms to the first byte, "
      f"+{med['with model GPU'][1] - med['without'][1]:.1f} ms to power-off")

def switches(pid):
    out = {}
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            comm = open(f"/proc/{pid}/task/{tid}/comm").read().strip()
            st = open(f"/proc/{pid}/task/{tid}/status").read().split("\n")
        except FileNotFoundError:
            continue
        n = sum(int(l.split()[1]) for l in st if l.endswith("ctxt_switches") or "ctxt_switches:" in l)
        out[f"{comm}/{tid}"] = n
    return out

p = start(["--device", "model-gpu"], "vfio-irq-bench", f"tvm.n={irqs}")
before = after = None
detail = ""
for line in p.stdout:
    line = line.decode(errors="replace")
    if "vfio-irq-bench GO" in line:
        before = switches(p.pid)
    elif "vfio-irq-bench END" in line:
        after = switches(p.pid)
    elif "vfio-irq-bench PASS" in line or "vfio-irq-bench FAIL" in line:
        detail = line.strip()
p.wait()
if not before or not after or "PASS" not in detail:
    raise SystemExit(f"bench-vfio: the interrupt benchmark did not run: {detail}")
fields = dict(kv.split("=") for kv in detail.split("PASS", 1)[1].split())
print(f"2. MSI-X round trips (doorbell write, device eventfd -> KVM irqfd -> guest): "
      f"{fields['per_second']}/s over {fields['n']}")
for name in sorted(after):
    d = after[name] - before.get(name, 0)
    kind = "vCPU" if name.startswith("vcpu") else "VMM"
    print(f"   {kind:4} thread {name:28} context switches {d:6}  per interrupt {d / irqs:.4f}")
PY

if [ "${BENCH_NESTED:-0}" = 1 ]; then
    echo "3. nested host: edu MSI round trips, tenantvm-vmm and QEMU vfio-pci (same guest)"
    scripts/nested-host.sh --release bench-vfio-edu 2>/dev/null | sed -n 's/^NOTE [a-z-]*: /   /p; /^FAIL/p'
fi
