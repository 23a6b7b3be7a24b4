//! The simulated GPU backend under concurrency: creates from many threads (each its own
//! backend handle, as separate processes would have) never get overlapping slices.

use std::path::PathBuf;

use tenantvm_gpu::backend::sim::SimBackend;
use tenantvm_gpu::backend::{BackendError, GpuBackend};

#[test]
fn concurrent_creates_never_get_the_same_slice() {
    let dir = tempfile::tempdir().unwrap();
    let host = dir.path().join("host.json");
    std::fs::copy(
        PathBuf::from(env!("CARGO_MANIFEST_DIR"))
            .join("../../tests/fixtures/hosts/sim-h100x8.json"),
        &host,
    )
    .unwrap();
    // GPU 2 is empty with MIG on: seven 1g starts, sixteen threads racing for them.
    let handles: Vec<_> = (0..16)
        .map(|i| {
            let host = host.clone();
            std::thread::spawn(move || {
                let b = SimBackend::open(&host).unwrap();
                let mut got = Vec::new();
                for start in (0..7).map(|s| (s + i) % 7) {
                    match b.create_instance(2, 19, start) {
                        Ok(gi) => got.push(gi.start),
                        Err(BackendError::InsufficientResources { .. }) => {}
                        Err(e) => panic!("unexpected: {e}"),
                    }
                }
                got
            })
        })
        .collect();
    let mut starts: Vec<u32> = handles
        .into_iter()
        .flat_map(|h| h.join().unwrap())
        .collect();
    starts.sort_unstable();
    assert_eq!(starts, vec![0, 1, 2, 3, 4, 5, 6]);
    let b = SimBackend::open(&host).unwrap();
    assert_eq!(b.gpus().unwrap()[2].instances.len(), 7);
}
