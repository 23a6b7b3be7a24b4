//! The agent binary's `load-worker gpu-memory` (what the agent runs as its child for the
//! load) against the FAKE CUDA driver of tests/fake_cuda/fake_libcuda_alloc.c, installed as
//! `libcuda.so.1` on the worker's library path: the worker dispatch (and `gpu-compute`'s), its
//! progress lines and exit status, and the plain error and exit 1 without a driver.

use std::path::Path;
use std::process::Command;

const AGENT: &str = env!("CARGO_BIN_EXE_tenantvm-agent");

fn worker(lib_dir: Option<&Path>, limit_mib: &str) -> std::process::Output {
    worker_of("gpu-memory", "4096", lib_dir, limit_mib)
}

fn worker_of(
    kind: &str,
    amount: &str,
    lib_dir: Option<&Path>,
    limit_mib: &str,
) -> std::process::Output {
    let mut cmd = Command::new(AGENT);
    cmd.args(["load-worker", kind, amount, "1", "/"])
        .env_clear()
        .env("FAKE_CUDA_MEMORY_MIB", limit_mib);
    if let Some(d) = lib_dir {
        cmd.env("LD_LIBRARY_PATH", d);
    }
    cmd.output().unwrap()
}

#[test]
fn the_worker_allocates_to_the_fake_drivers_limit_and_says_plainly_when_there_is_none() {
    let dir = tempfile::tempdir().unwrap();
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fake_cuda/fake_libcuda_alloc.c");
    match Command::new("cc")
        .args(["-shared", "-fPIC", "-O2", "-o"])
        .arg(dir.path().join("libcuda.so.1"))
        .arg(&src)
        .status()
    {
        Ok(s) => assert!(s.success(), "building the fake CUDA driver failed: {s}"),
        Err(e) => tenantvm_skip::skip!("no C compiler to build the fake CUDA driver ({e})"),
    }
    let out = worker(Some(dir.path()), "1500");
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{out:?}");
    assert_eq!(text.lines().last(), Some("progress 1500"), "{text}");
    // The compute load: a second of launches, each 64 blocks' multiply-adds.
    let out = worker_of("gpu-compute", "64", Some(dir.path()), "1500");
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{out:?}");
    let done: u64 = text
        .lines()
        .last()
        .and_then(|l| l.strip_prefix("progress "))
        .and_then(|n| n.parse().ok())
        .unwrap_or(0);
    let per_launch = tenantvm_agent::cuda_compute::fmas_per_launch(64) / 1_000_000;
    assert!(done >= per_launch, "{text}");

    // An empty directory on the path: no driver anywhere the worker looks, unless this
    // host has a real one on its default path.
    // SAFETY: a valid C string; a real driver's initialisers have no preconditions.
    let real = unsafe { libc::dlopen(c"libcuda.so.1".as_ptr(), libc::RTLD_LAZY) };
    if !real.is_null() {
        // SAFETY: the handle just opened, closed once.
        unsafe { libc::dlclose(real) };
        tenantvm_skip::skip!("this host has a real libcuda.so.1: the no-driver half cannot run");
    }
    let empty = tempfile::tempdir().unwrap();
    let out = worker(Some(empty.path()), "1500");
    assert_eq!(out.status.code(), Some(1), "{out:?}");
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("no CUDA driver in the guest: cannot load libcuda.so.1"),
        "{err}"
    );
    assert!(out.stdout.is_empty());
}
