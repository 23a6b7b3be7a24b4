//! The agent's GPU memory load against a FAKE CUDA driver (tests/fake_cuda/fake_libcuda_alloc.c,
//! built here with `cc`; it counts bytes against `FAKE_CUDA_MEMORY_MIB` and takes no memory):
//! the real dlopen/dlsym loading, the chunked allocation with its out-of-memory back-off, the
//! cap, freeing everything, and the plain error when there is no driver; and the compute
//! load's module, launches and clean-up. Skips with a printed
//! reason when no C compiler is present. The hardware test runs with TENANTVM_TEST_GPU.

use std::ffi::CString;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use tenantvm_agent::cuda::{CudaError, CUDA_LIBRARY};
use tenantvm_agent::cuda_compute::{fmas_per_launch, FMAS_PER_ROUND, KERNEL, PTX};
use tenantvm_agent::load::{gpu_compute, gpu_memory, WorkerError};

/// Builds the fake driver into `dir`; `None` (after recording why) without a C compiler.
fn build_fake(dir: &Path) -> Option<PathBuf> {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fake_cuda/fake_libcuda_alloc.c");
    let out = dir.join("libcuda-fake.so");
    match Command::new("cc")
        .args(["-shared", "-fPIC", "-O2", "-o"])
        .arg(&out)
        .arg(&src)
        .status()
    {
        Ok(s) if s.success() => Some(out),
        Ok(s) => panic!("building the fake CUDA driver failed: {s}"),
        Err(e) => {
            tenantvm_skip::record_skip!("no C compiler to build the fake CUDA driver ({e})");
            None
        }
    }
}

/// The last `progress N` line.
fn last_progress(out: &[u8]) -> u64 {
    String::from_utf8_lossy(out)
        .lines()
        .rev()
        .find_map(|l| l.strip_prefix("progress "))
        .and_then(|n| n.parse().ok())
        .expect("a progress line")
}

/// The fake's own counters, read through a handle the test keeps open (so the library, and
/// its counters, stay loaded between the load's dlopen and dlclose).
struct FakeCounters {
    handle: *mut std::ffi::c_void,
}

impl FakeCounters {
    fn open(lib: &Path) -> FakeCounters {
        let name = CString::new(lib.to_str().unwrap()).unwrap();
        // SAFETY: a valid C string; the fake's initialisers do nothing.
        let handle = unsafe { libc::dlopen(name.as_ptr(), libc::RTLD_NOW) };
        assert!(!handle.is_null());
        FakeCounters { handle }
    }

    /// Calls the fake's counter `name`, a `T name(void)` function.
    fn read<T>(&self, name: &std::ffi::CStr) -> T {
        // SAFETY: a live handle and a valid C string.
        let f = unsafe { libc::dlsym(self.handle, name.as_ptr()) };
        assert!(!f.is_null(), "{name:?}");
        // SAFETY: the fake defines each counter read here as `T name(void)`, with T an
        // `unsigned long long` (u64) or an `int` (i32) as the caller names it.
        let f: extern "C" fn() -> T = unsafe { std::mem::transmute_copy(&f) };
        f()
    }

    fn outstanding(&self) -> u64 {
        self.read(c"fake_cuda_outstanding")
    }

    fn contexts(&self) -> i32 {
        self.read(c"fake_cuda_contexts")
    }
}

impl Drop for FakeCounters {
    fn drop(&mut self) {
        // SAFETY: the handle came from dlopen and is closed once.
        unsafe { libc::dlclose(self.handle) };
    }
}

/// Held by each test that sets FAKE_CUDA_MEMORY_MIB: the environment is the process's,
/// and the fake reads it at cuCtxCreate.
static ENV: std::sync::Mutex<()> = std::sync::Mutex::new(());

#[test]
fn fake_driver_allocation_stops_at_its_limit_or_the_cap_and_frees_everything() {
    let _env = ENV.lock().unwrap_or_else(|p| p.into_inner());
    let dir = tempfile::tempdir().unwrap();
    let Some(lib) = build_fake(dir.path()) else {
        return;
    };
    let counters = FakeCounters::open(&lib);
    let lib = lib.to_str().unwrap();
    std::env::set_var("FAKE_CUDA_MEMORY_MIB", "1000");
    // Out of memory at 1000 MiB: 3 x 256, then halving chunks fill the rest exactly.
    let mut out = Vec::new();
    gpu_memory(&mut out, lib, 4096, Duration::from_millis(10)).unwrap();
    assert_eq!(last_progress(&out), 1000);
    assert!(String::from_utf8_lossy(&out).starts_with("progress 256\n"));
    assert_eq!(counters.outstanding(), 0, "everything freed");
    assert_eq!(counters.contexts(), 0, "the context destroyed");
    // A cap below the limit stops there.
    let mut out = Vec::new();
    gpu_memory(&mut out, lib, 300, Duration::from_millis(10)).unwrap();
    assert_eq!(last_progress(&out), 300);
    assert_eq!(counters.outstanding(), 0);
    // A limit that is no multiple of a chunk: the back-off ends within 1 MiB of it.
    std::env::set_var("FAKE_CUDA_MEMORY_MIB", "777");
    let mut out = Vec::new();
    gpu_memory(&mut out, lib, 4096, Duration::from_millis(10)).unwrap();
    assert_eq!(last_progress(&out), 777);
    // Nothing to take at all.
    std::env::set_var("FAKE_CUDA_MEMORY_MIB", "0");
    let mut out = Vec::new();
    gpu_memory(&mut out, lib, 4096, Duration::from_millis(10)).unwrap();
    assert_eq!(last_progress(&out), 0);
    assert_eq!(counters.contexts(), 0);
}

#[test]
fn the_compute_load_launches_the_ptx_kernel_until_its_deadline_and_cleans_up() {
    let dir = tempfile::tempdir().unwrap();
    let Some(lib) = build_fake(dir.path()) else {
        return;
    };
    let counters = FakeCounters::open(&lib);
    let _env = ENV.lock().unwrap_or_else(|p| p.into_inner());
    std::env::set_var("FAKE_CUDA_MEMORY_MIB", "1000");
    let mut out = Vec::new();
    gpu_compute(
        &mut out,
        lib.to_str().unwrap(),
        64,
        Duration::from_millis(300),
    )
    .unwrap();
    let launches: u64 = counters.read(c"fake_cuda_launches");
    let fmas: u64 = counters.read(c"fake_cuda_fmas");
    assert!(launches >= 1);
    assert_eq!(counters.read::<u64>(c"fake_cuda_blocks"), launches * 64);
    assert_eq!(
        fmas,
        launches * fmas_per_launch(64),
        "the rounds the kernel was given"
    );
    // The last progress line is every launch's multiply-adds, in millions.
    assert_eq!(last_progress(&out), fmas / 1_000_000);
    assert_eq!(
        counters.read::<i32>(c"fake_cuda_modules"),
        0,
        "module unloaded"
    );
    assert_eq!(counters.outstanding(), 0, "output buffer freed");
    assert_eq!(counters.contexts(), 0, "context destroyed");
}

#[test]
fn the_compute_kernel_is_ptx_for_the_jit_with_the_parameters_it_is_launched_with() {
    // What the fake driver cannot check: the text a real driver's JIT compiles.
    assert!(PTX.starts_with(".version 6.0\n.target sm_50\n.address_size 64\n"));
    assert!(PTX.contains(&format!(".visible .entry {KERNEL}(")));
    assert!(PTX.contains(".param .u32 tenantvm_spin_rounds"));
    assert!(PTX.contains(".param .u64 tenantvm_spin_out"));
    assert_eq!(PTX.matches("fma.rn.f32").count() as u64, FMAS_PER_ROUND);
    assert_eq!(PTX.matches('{').count(), PTX.matches('}').count());
    assert!(!PTX.contains('\0'));
}

#[test]
fn no_cuda_driver_is_said_plainly() {
    let mut out = Vec::new();
    let err = gpu_memory(
        &mut out,
        "/nonexistent/libcuda.so.1",
        64,
        Duration::from_millis(1),
    )
    .unwrap_err();
    let compute = gpu_compute(
        &mut out,
        "/nonexistent/libcuda.so.1",
        64,
        Duration::from_millis(1),
    )
    .unwrap_err();
    assert!(
        compute
            .to_string()
            .starts_with("no CUDA driver in the guest"),
        "{compute}"
    );
    assert!(
        matches!(err, WorkerError::Cuda(CudaError::Missing { .. })),
        "{err:?}"
    );
    assert!(
        err.to_string().starts_with("no CUDA driver in the guest"),
        "{err}"
    );
    assert!(out.is_empty());
}

#[test]
fn a_library_that_is_not_a_cuda_driver_is_refused() {
    let err = gpu_memory(&mut Vec::new(), "libc.so.6", 64, Duration::from_millis(1)).unwrap_err();
    assert!(
        matches!(
            err,
            WorkerError::Cuda(CudaError::Symbol {
                symbol: "cuInit",
                ..
            })
        ),
        "{err:?}"
    );
}

/// The hardware test: runs only when TENANTVM_TEST_GPU is set (on a host, or inside a guest,
/// whose CUDA driver sees a GPU): device 0 gives at least 64 MiB, up to a 1 GiB cap.
#[test]
fn real_driver_allocates_and_frees() {
    if std::env::var_os("TENANTVM_TEST_GPU").is_none() {
        tenantvm_skip::skip!("set TENANTVM_TEST_GPU=<index> on a host with a CUDA driver to run the GPU memory load test");
    }
    let mut out = Vec::new();
    gpu_memory(&mut out, CUDA_LIBRARY, 1024, Duration::from_millis(100)).unwrap();
    let got = last_progress(&out);
    assert!((64..=1024).contains(&got), "{got} MiB");
}

/// The compute load on a real driver (TENANTVM_TEST_GPU set, on a host or in a guest whose
/// CUDA driver sees a GPU): the driver's JIT takes the PTX, and a second of launches does
/// at least one launch's multiply-adds. What no fake can show: that the kernel text is
/// valid PTX for this GPU.
#[test]
fn real_driver_runs_the_compute_kernel() {
    if std::env::var_os("TENANTVM_TEST_GPU").is_none() {
        tenantvm_skip::skip!("set TENANTVM_TEST_GPU=<index> on a host with a CUDA driver to run the GPU compute load test");
    }
    let mut out = Vec::new();
    gpu_compute(&mut out, CUDA_LIBRARY, 1024, Duration::from_secs(1)).unwrap();
    let done = last_progress(&out);
    assert!(
        done >= fmas_per_launch(1024) / 1_000_000,
        "{done} million multiply-adds"
    );
    eprintln!(
        "gpu-compute on device 0: {done} million multiply-adds in 1 s ({:.2} TFMA/s)",
        done as f64 / 1e6
    );
}
