//! Placement through the daemon (run by `cargo bench -p tenantvm --bench gpu_placement`):
//! 50 GPU tenants created one after another through the daemon's own service
//! (`TenantService`: validation, the fail-fast placement, every create step recorded in the
//! SQLite store, reserve-gpu's exact placement over the ledger and the host, the MIG
//! instance made on a SIMULATED host of 8 H100s (the host file rewritten with an fsync per
//! change), bind and attach), with the VM launch itself stubbed (a no-op backend named as
//! such: this measures the control plane's GPU work, not a VMM). Prints the reserve-gpu
//! step's time (the placement: its share of the store records' started/finished
//! milliseconds, summed), the whole create's, and how many were placed.

use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, Instant};

use tenantvm::auth::Caller;
use tenantvm::backend::{
    BackendError, BackendKind, ExitReason, JailConfig, RunningVm, VmBackend, VmSpec, VmState,
};
use tenantvm::domain::lifecycle::LifecycleState;
use tenantvm::domain::spec::TenantSpec;
use tenantvm::gpu::BackendPlanner;
use tenantvm::jail::{BlockIoLimit, BlockIoOutcome, CgroupHandle, JailError};
use tenantvm::store::Store;
use tenantvm::tenant::host::JailCleaner;
use tenantvm::tenant::service::{ServiceConfig, TenantCommand, TenantService};
use tenantvm_agent_protocol::AgentEndpoint;
use tenantvm_gpu::backend::{self as gpu_backend, BackendSpec};

/// NO-OP VM backend (benchmark stub): every VM "runs" at once.
struct NoVms;

impl VmBackend for NoVms {
    fn kind(&self) -> BackendKind {
        BackendKind::TenantvmVmm
    }
    fn launch(&self, spec: &VmSpec, jail: &JailConfig) -> Result<RunningVm, BackendError> {
        Ok(RunningVm {
            vsock_cid: None,
            backend: BackendKind::TenantvmVmm,
            tenant: spec.tenant.clone(),
            pid: std::process::id() as i32,
            start_time_ticks: 0,
            api_sock: spec.tenant_dir.join("api.sock"),
            tenant_dir: spec.tenant_dir.clone(),
            cgroup: CgroupHandle::V2 {
                path: Path::new("/nonexistent").join(&spec.tenant),
            },
            uid: jail.uid,
        })
    }
    fn state(&self, _vm: &RunningVm) -> Result<VmState, BackendError> {
        Ok(VmState::Running)
    }
    fn ended(&self, _vm: &RunningVm) -> Result<Option<VmState>, BackendError> {
        Ok(None)
    }
    fn stop(&self, _vm: &RunningVm, _grace: Duration) -> Result<ExitReason, BackendError> {
        Ok(ExitReason::Stopped)
    }
    fn kill(&self, _vm: &RunningVm) -> Result<(), BackendError> {
        Ok(())
    }
    fn agent_endpoint(&self, vm: &RunningVm) -> AgentEndpoint {
        AgentEndpoint::Serial(vm.tenant_dir.join("agent.sock"))
    }
    fn agent_transport(&self) -> &'static str {
        "virtio-serial"
    }
}

/// NO-OP jail cleaner (benchmark stub).
struct NoJails;

impl JailCleaner for NoJails {
    fn cleanup(&self, _tenant: &str, _tenant_dir: &Path) -> Result<(), JailError> {
        Ok(())
    }
    fn list(&self) -> Result<Vec<String>, JailError> {
        Ok(Vec::new())
    }
    fn limit_block_io(
        &self,
        _tenant: &str,
        disks: &[std::path::PathBuf],
        _limit: BlockIoLimit,
    ) -> Result<Vec<BlockIoOutcome>, JailError> {
        Ok(disks
            .iter()
            .map(|d| BlockIoOutcome::NotLimited {
                disk: d.clone(),
                reason: "benchmark stub".into(),
            })
            .collect())
    }
}

/// The i-th tenant's request: 1g.10gb slices and a sized model that needs one (50 one-slot
/// slices: 8 H100s hold 56); with `BENCH_GPU_MIX=mixed` the first two ask for 1g.20gb.
fn gpu_table(i: usize, mixed: bool) -> &'static str {
    match (i, i % 5) {
        (0 | 1, _) if mixed => "{ profile = \"1g.20gb\" }",
        (_, 3) => "{ model = \"mistral-7b\", dtype = \"int4\" }",
        _ => "{ profile = \"1g.10gb\" }",
    }
}

fn round(dir: &Path, mixed: bool) -> (Duration, Duration, usize) {
    let images = dir.join("images/hello");
    std::fs::create_dir_all(&images).unwrap();
    std::fs::write(images.join("kernel"), b"not a kernel: the VM is a stub").unwrap();
    let host = dir.join("sim-h100x8.json");
    std::fs::copy(
        Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/fixtures/hosts/sim-h100x8.json"),
        &host,
    )
    .unwrap();
    // Empty the simulated GPUs so the 50 slices are all this round's.
    let mut doc: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&host).unwrap()).unwrap();
    for g in doc["gpus"].as_array_mut().unwrap() {
        g["instances"] = serde_json::json!([]);
        g["mig_enabled"] = serde_json::json!(true);
        g["assigned_whole"] = serde_json::json!(false);
    }
    std::fs::write(&host, doc.to_string()).unwrap();
    let planner = BackendPlanner::new(gpu_backend::open(&BackendSpec::Sim(host)).unwrap());
    let store = Arc::new(Store::open(&dir.join("state.db")).unwrap());
    let mut cfg = ServiceConfig::new(dir.join("state"));
    cfg.image_dir = Some(dir.join("images"));
    cfg.departure.kek = tenantvm::keys::KekSource::File(dir.join("host-kek"));
    cfg.departure.keyslot_cost = tenantvm::disk::KeyslotCost::TEST;
    cfg.capacity = tenantvm::tenant::admission::HostCapacity::fixed(1 << 20, 1024);
    let svc = TenantService::new(
        store,
        Arc::new(NoVms),
        Arc::new(NoJails),
        Arc::new(planner),
        cfg,
    );
    let mut placement = Duration::ZERO;
    let mut placed = 0;
    let t0 = Instant::now();
    for i in 0..50 {
        let name = format!("t{i:02}");
        let spec = TenantSpec::from_toml(&format!(
            "name = \"{name}\"\nmemory_mib = 32\ngpu = {}\n[image]\nname = \"hello\"\n",
            gpu_table(i, mixed)
        ))
        .unwrap();
        if let Err(e) = svc.execute(&Caller::Admin, TenantCommand::Create(spec)) {
            eprintln!("{name} refused: {e}");
            continue;
        }
        svc.wait_idle();
        let t = svc.store().tenant(&name).unwrap().unwrap();
        if t.state == LifecycleState::Running {
            placed += 1;
        }
        for s in svc.store().steps(t.op_id.unwrap()).unwrap() {
            if s.step == "reserve-gpu" {
                let ms = s.finished_ms.unwrap_or(s.started_ms) - s.started_ms;
                placement += Duration::from_millis(ms.max(0) as u64);
            }
        }
    }
    (placement, t0.elapsed(), placed)
}

fn main() {
    if std::env::args().any(|a| a == "--list") {
        println!("gpu_placement: bench");
        return;
    }
    let mixed = std::env::var("BENCH_GPU_MIX").as_deref() == Ok("mixed");
    let mut rows = Vec::new();
    for _ in 0..5 {
        let dir = tempfile::tempdir().unwrap();
        rows.push(round(dir.path(), mixed));
    }
    rows.sort_by_key(|r| r.0);
    for (p, total, placed) in &rows {
        println!(
            "50 GPU tenants on 8 x h100-80gb (SIMULATED) through the daemon's service: reserve-gpu {:.0} ms in all, create {:.0} ms in all, {placed} placed",
            p.as_secs_f64() * 1e3,
            total.as_secs_f64() * 1e3
        );
    }
    let (p, total, placed) = rows[rows.len() / 2];
    println!(
        "median: placement {:.0} ms (goal < 1000 ms), whole creates {:.0} ms, {placed}/50 placed",
        p.as_secs_f64() * 1e3,
        total.as_secs_f64() * 1e3
    );
}
