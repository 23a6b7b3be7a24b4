//! Runtime latency: jailed launch-to-ready, stop and kill of `tenantvm-vmm` VMs with a tiny
//! spinning guest, and cleanup of the tenant's cgroup. Needs root, /dev/kvm and built
//! `tenantvm-vmm` + `tenantvm-jail` (`cargo build -p tenantvm-vmm -p tenantvm-jail --bins`).
//!
//! usage: cargo bench -p tenantvm --bench runtime_launch [-- ROUNDS]

use std::fs;
use std::path::PathBuf;
use std::time::{Duration, Instant};

use tenantvm::backend::runner::sibling_binary;
use tenantvm::backend::{JailConfig, ResourceLimits, RuntimeConfig, VmBackend, VmSpec, VmmBackend};
use tenantvm::jail::cleanup_tenant;

/// A minimal x86_64 ELF whose code spins at 1 MiB.
fn spin_elf() -> Vec<u8> {
    let code = [0xebu8, 0xfe];
    let mut img = Vec::new();
    img.extend_from_slice(b"\x7fELF\x02\x01\x01\0\0\0\0\0\0\0\0\0");
    img.extend_from_slice(&2u16.to_le_bytes());
    img.extend_from_slice(&62u16.to_le_bytes());
    img.extend_from_slice(&1u32.to_le_bytes());
    img.extend_from_slice(&0x10_0000u64.to_le_bytes());
    img.extend_from_slice(&64u64.to_le_bytes());
    img.extend_from_slice(&0u64.to_le_bytes());
    img.extend_from_slice(&0u32.to_le_bytes());
    for v in [64u16, 56, 1, 64, 0, 0] {
        img.extend_from_slice(&v.to_le_bytes());
    }
    img.extend_from_slice(&1u32.to_le_bytes());
    img.extend_from_slice(&7u32.to_le_bytes());
    for v in [0x1000u64, 0x10_0000, 0x10_0000, 2, 2, 0x1000] {
        img.extend_from_slice(&v.to_le_bytes());
    }
    img.resize(0x1000, 0);
    img.extend_from_slice(&code);
    img
}

/// `name` next to this bench, else in the workspace's target/release or target/debug.
fn find_binary(name: &str) -> PathBuf {
    let next_to_us = sibling_binary(name).unwrap();
    if next_to_us.exists() {
        return next_to_us;
    }
    let target = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../target");
    let release = target.join("release").join(name);
    if release.exists() {
        return release;
    }
    target.join("debug").join(name)
}

fn summary(name: &str, mut samples: Vec<Duration>) {
    samples.sort();
    let ms = |d: Duration| d.as_secs_f64() * 1000.0;
    println!(
        "{name:<22} n={:<3} min {:>7.1} ms  median {:>7.1} ms  max {:>7.1} ms",
        samples.len(),
        ms(samples[0]),
        ms(samples[samples.len() / 2]),
        ms(samples[samples.len() - 1])
    );
}

fn main() {
    let rounds: usize = std::env::args()
        .skip(1)
        .find_map(|a| a.parse().ok())
        .unwrap_or(10);
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } != 0 || !PathBuf::from("/dev/kvm").exists() {
        tenantvm_skip::skip!("needs root and /dev/kvm");
    }
    let vmm = find_binary("tenantvm-vmm");
    let jail_bin = find_binary("tenantvm-jail");
    if !vmm.exists() || !jail_bin.exists() {
        tenantvm_skip::skip!("build tenantvm-vmm and tenantvm-jail first (cargo build -p tenantvm-vmm -p tenantvm-jail --bins)");
    }
    let mut config = RuntimeConfig::detect().unwrap();
    config.jail_binary = jail_bin;
    let cgroups = config.cgroups.clone();
    let backend = VmmBackend::new(vmm, config);
    let tmp = tempfile::tempdir().unwrap();
    let kernel = tmp.path().join("spin.elf");
    fs::write(&kernel, spin_elf()).unwrap();
    let (mut launch, mut stop, mut kill, mut cleanup) =
        (Vec::new(), Vec::new(), Vec::new(), Vec::new());
    for i in 0..rounds {
        for graceful in [true, false] {
            let tenant = format!("bench-{}-{i}-{graceful}", std::process::id());
            let dir = tmp.path().join(&tenant);
            fs::create_dir(&dir).unwrap();
            let spec = VmSpec {
                vsock_cid: None,
                tenant: tenant.clone(),
                kernel: kernel.clone(),
                initramfs: None,
                cmdline: String::new(),
                vcpus: 1,
                memory_mib: 32,
                disks: vec![],
                tenant_dir: dir.clone(),
                devices: vec![],
                uuid: None,
                hugepages: None,
            };
            let uid = 300_000 + u32::try_from(i).unwrap();
            let jail = JailConfig {
                uid,
                gid: uid,
                limits: ResourceLimits {
                    memory_bytes: 256 << 20,
                    cpu_quota_us: 20_000,
                    cpu_period_us: 100_000,
                    pids_max: 64,
                },
            };
            let t = Instant::now();
            let vm = backend.launch(&spec, &jail).unwrap();
            launch.push(t.elapsed());
            let t = Instant::now();
            if graceful {
                backend.stop(&vm, Duration::from_secs(10)).unwrap();
                stop.push(t.elapsed());
            } else {
                backend.kill(&vm).unwrap();
                kill.push(t.elapsed());
            }
            let t = Instant::now();
            cleanup_tenant(&cgroups, &tenant, &dir).unwrap();
            cleanup.push(t.elapsed());
        }
    }
    summary("launch to ready", launch);
    summary("stop (socket)", stop);
    summary("kill (cgroup)", kill);
    summary("cleanup_tenant", cleanup);
}
