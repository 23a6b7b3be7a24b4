//! The nested test host (docs/testing.md).
//!
//! This machine's kernel cannot run a stock Linux guest under KVM and has no IOMMU, vfio,
//! device-mapper or vhost-vsock; one level down, under QEMU's TCG with `-cpu max`, all of it
//! exists. The harness builds an outer guest from what setup and the build made
//! (build-rootfs.sh), boots it ([`outer`]), runs named scenarios inside (shell scripts in
//! `tests/nested-host/scenarios/`, [`catalog`]) one after the other with their own limits,
//! and follows their results on a virtio-serial port ([`watch`]). With `TENANTVM_HOST=real`
//! the same scenarios run directly on a real host ([`real`]).
//!
//! The crate's binaries: `nested-host` (the command behind scripts/nested-host.sh) and the
//! test-only programs the scenarios run inside the outer guest: `nh-stock-kernel`,
//! `nh-guest-image`, `nh-vfio-kernel`, `nh-inference-tenant`, `nh-gpu-tenant`,
//! `nh-vgpu-sriov` (those two over [`gpu_tenant`]), `nh-llama-tenant` (it and
//! `nh-inference-tenant` over [`inference`]).

pub mod catalog;
pub mod cli;
pub mod cpio;
pub mod gpu_tenant;
pub mod heartbeat;
pub mod inference;
pub mod inputs;
pub mod outer;
pub mod real;
pub mod scenario;
pub mod stock;
pub mod stock_vfio;
pub mod vm;
pub mod watch;

use std::path::{Path, PathBuf};

pub use catalog::{Catalog, CatalogError, Scenario};
pub use inputs::{Inputs, InputsError};
pub use outer::{OuterConfig, RootFormat};
pub use watch::{Outcome, Progress, Verdict};

/// Why a run could not start.
#[derive(Debug, thiserror::Error)]
pub enum HarnessError {
    /// The scenarios could not be chosen.
    #[error(transparent)]
    Catalog(#[from] CatalogError),
    /// The inputs are missing or incomplete.
    #[error(transparent)]
    Inputs(#[from] InputsError),
    /// A tool, file or folder the run needs is missing or failed.
    #[error("{0}")]
    Setup(String),
}

/// The repository root.
pub fn repo_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}

/// tests/nested-host: build-rootfs.sh, init.sh, run-scenarios.sh, lib.sh, scenarios/.
pub fn harness_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

/// Runs whose files are kept in target/nested-host/runs.
const RUNS_KEPT: usize = 5;

/// Where a run's files go: `target/nested-host/runs/<pid>`. Older runs beyond the last few
/// are removed.
pub fn default_work_dir() -> PathBuf {
    let runs = repo_root().join("target/nested-host/runs");
    if let Ok(entries) = std::fs::read_dir(&runs) {
        let mut dirs: Vec<(std::time::SystemTime, PathBuf)> = entries
            .flatten()
            .filter_map(|e| Some((e.metadata().ok()?.modified().ok()?, e.path())))
            .collect();
        dirs.sort();
        let excess = dirs.len().saturating_sub(RUNS_KEPT - 1);
        for (_, dir) in dirs.into_iter().take(excess) {
            let _ = std::fs::remove_dir_all(dir);
        }
    }
    runs.join(std::process::id().to_string())
}

/// Runs `scenarios` on the nested host (one boot of the outer guest), or on this host when
/// `TENANTVM_HOST=real`; calls `report` with each outcome as it arrives.
pub fn run(
    cfg: &OuterConfig,
    inputs: &Inputs,
    scenarios: &[Scenario],
    report: &mut dyn FnMut(&Progress),
) -> Result<Vec<Outcome>, HarnessError> {
    if real::requested() {
        real::run(cfg.work_dir.clone(), inputs, scenarios, report)
    } else {
        outer::run(cfg, inputs, scenarios, report)
    }
}
