//! Fakes for in-process tests of the service and reconciliation, named as such: a fake
//! host where "processes" and "cgroups" are entries in a map. The end-to-end tests in
//! orchestrator/tests/ use the real VMM and cgroups instead.

use std::collections::{BTreeMap, BTreeSet};
use std::os::unix::net::UnixListener;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tenantvm_agent_protocol::AgentEndpoint;

use crate::backend::{
    BackendError, BackendKind, ExitReason, JailConfig, RunningVm, VmBackend, VmSpec, VmState,
};
use crate::domain::spec::GpuRequest;
use crate::gpu::error::plan_err;
use crate::gpu::{Cleaning, Describe, DeviceRoute, GpuError, GpuHost, Placement};
use crate::jail::{CgroupHandle, JailError};
use crate::store::{GpuPlacement, Store};
use crate::tenant::fault::FaultHook;
use crate::tenant::host::JailCleaner;
use crate::tenant::service::{ServiceConfig, TenantService};

/// Records tenant `name` (running on the fake host) as running a guest image with an agent
/// and listens on the socket where the daemon reaches that agent, as the tenant's uid, which
/// the daemon's peer check wants (needs root). The test serves the listener as the tenant's
/// FAKE agent.
pub fn fake_agent_socket(svc: &TenantService, name: &str) -> UnixListener {
    let t = svc.store().tenant(name).unwrap().unwrap();
    svc.store()
        .set_guest(t.id, crate::domain::GuestKind::Agent)
        .unwrap();
    let ctx = svc.ctx();
    let vm = crate::tenant::context::Tenant::load(&ctx, &t)
        .unwrap()
        .vm
        .unwrap();
    let sock = crate::tenant::steps::guest::agent_endpoint(ctx.backend, &vm)
        .path()
        .expect("a socket endpoint")
        .to_path_buf();
    std::fs::create_dir_all(sock.parent().unwrap()).unwrap();
    crate::test_support::peercred::listen_as(&sock, vm.uid).unwrap()
}

/// A FAKE tree holding one device like the nested host's edu (QEMU's 1234:11e8: no host
/// driver, no reset method, alone in IOMMU group 5) at 0000:00:03.0.
pub const EDU_TREE: &str = r#"{"devices": [{"bdf": "0000:00:03.0",
    "vendor": "0x1234", "device": "0x11e8", "class": "0x00ff00", "iommu_group": 5,
    "reset_method": ""}], "drivers": ["vfio-pci"], "modules": ["vfio", "vfio_pci"]}"#;

/// A SIMULATED whole-only GPU (an L40S) at the edu's address.
pub const SIM_AT_EDU: &str = r#"{"gpus": [{"index": 0, "model": "l40s",
    "pci_address": "0000:00:03.0", "driver": "550.54.15", "vgpu": "none",
    "iommu_group": 5}]}"#;

/// What the fake host holds.
#[derive(Debug, Default)]
pub struct FakeHostState {
    /// Live fake processes: pid -> tenant.
    pub processes: BTreeMap<i32, String>,
    /// Fake cgroups, by tenant.
    pub cgroups: BTreeSet<String>,
    /// Next pid.
    pub next_pid: i32,
    /// Make the next launches fail.
    pub fail_launch: bool,
    /// Limits each launch asked for.
    pub launched_with: Vec<JailConfig>,
    /// Fake processes that run but whose control socket does not answer (a wedged VMM):
    /// `state` fails, and `stop` ends with the kill after its grace.
    pub unresponsive: BTreeSet<i32>,
    /// Launch every new VM unresponsive (its boot never reports running).
    pub launch_unresponsive: bool,
    /// Fake processes whose `state` blocks (a silent VMM) until removed from this set, or
    /// 30 s at most.
    pub stalled: BTreeSet<i32>,
    /// Name the agent's channel as tenantvm-vmm does (a hybrid vsock socket) instead of a
    /// serial one.
    pub agent_vsock: bool,
    /// Report the QEMU backend (KVM) as this backend's kind instead of tenantvm-vmm.
    pub qemu: bool,
    /// The passthrough devices and VM UUID each launch was given: (tenant, devices, uuid).
    pub launched_devices: Vec<(
        String,
        Vec<crate::backend::PassthroughDevice>,
        Option<tenantvm_vmm_api::VmUuid>,
    )>,
    /// How often `state` (which asks the VMM) was called.
    pub state_calls: usize,
    /// How often `ended` (the process table only) was called.
    pub ended_calls: usize,
    /// Block I/O limits the launches asked the jail for: (tenant, disks, limit).
    pub block_io: Vec<(String, Vec<std::path::PathBuf>, crate::jail::BlockIoLimit)>,
    /// Act as QEMU on a host with vhost-vsock: specs must carry a vsock CID, and the
    /// agent is reached at it.
    pub vhost_vsock: bool,
    /// CIDs held by VMs this daemon does not know (another VMM on the host): a launch
    /// asking for one fails as QEMU does.
    pub foreign_cids: BTreeSet<u32>,
    /// The vsock CID each launch was given: (tenant, cid).
    pub launched_cids: Vec<(String, Option<u32>)>,
    /// The disk counters each tenant's fake VMM reports (none: it reports none).
    pub disk_counters: BTreeMap<String, crate::backend::DiskCounters>,
    /// `disk_counters` calls now waiting on a stalled VMM, and the most seen at once.
    pub disk_counters_waiting: usize,
    /// The most `disk_counters` calls seen waiting on stalled VMMs at once.
    pub disk_counters_most_waiting: usize,
}

/// A fake host shared by [`FakeBackend`] and the fake jail cleaner.
#[derive(Clone, Default)]
pub struct FakeHost(pub Arc<Mutex<FakeHostState>>);

impl FakeHost {
    /// Locks the state.
    pub fn state(&self) -> std::sync::MutexGuard<'_, FakeHostState> {
        self.0.lock().unwrap()
    }
}

/// A fake VM backend over [`FakeHost`].
pub struct FakeBackend(pub FakeHost);

impl VmBackend for FakeBackend {
    fn kind(&self) -> BackendKind {
        if self.0.state().qemu {
            BackendKind::Qemu {
                accel: crate::backend::QemuAccel::Kvm,
            }
        } else {
            BackendKind::TenantvmVmm
        }
    }

    fn launch(&self, spec: &VmSpec, jail: &JailConfig) -> Result<RunningVm, BackendError> {
        let mut h = self.0.state();
        if h.fail_launch {
            return Err(BackendError::InvalidSpec("fake launch failure".into()));
        }
        h.launched_cids.push((spec.tenant.clone(), spec.vsock_cid));
        if h.vhost_vsock && spec.vsock_cid.is_none() {
            return Err(BackendError::InvalidSpec("fake: no vsock CID".into()));
        }
        let live_cid = |cid: u32| {
            h.foreign_cids.contains(&cid)
                || h.launched_cids.iter().any(|(t, c)| {
                    *c == Some(cid) && *t != spec.tenant && h.processes.values().any(|p| p == t)
                })
        };
        if let Some(cid) = spec.vsock_cid.filter(|c| live_cid(*c)) {
            return Err(BackendError::LaunchFailed {
                reason: ExitReason::VmmError,
                log_tail: format!("qemu-system-x86_64: -device vhost-vsock-pci,id=vsock0,guest-cid={cid}: vhost-vsock: unable to set guest cid: Address already in use"),
            });
        }
        h.next_pid += 1;
        let pid = 1000 + h.next_pid;
        h.processes.insert(pid, spec.tenant.clone());
        if h.launch_unresponsive {
            h.unresponsive.insert(pid);
        }
        h.cgroups.insert(spec.tenant.clone());
        h.launched_with.push(jail.clone());
        h.launched_devices
            .push((spec.tenant.clone(), spec.devices.clone(), spec.uuid));
        Ok(RunningVm {
            vsock_cid: spec.vsock_cid,
            backend: BackendKind::TenantvmVmm,
            tenant: spec.tenant.clone(),
            pid,
            start_time_ticks: 7,
            api_sock: spec.tenant_dir.join("api.sock"),
            tenant_dir: spec.tenant_dir.clone(),
            cgroup: CgroupHandle::V2 {
                path: Path::new("/fake").join(&spec.tenant),
            },
            uid: jail.uid,
        })
    }

    fn state(&self, vm: &RunningVm) -> Result<VmState, BackendError> {
        self.0.state().state_calls += 1;
        let until = std::time::Instant::now() + Duration::from_secs(30);
        while self.0.state().stalled.contains(&vm.pid) && std::time::Instant::now() < until {
            std::thread::sleep(Duration::from_millis(10));
        }
        let h = self.0.state();
        if h.unresponsive.contains(&vm.pid) && h.processes.contains_key(&vm.pid) {
            return Err(BackendError::Control {
                path: vm.api_sock.clone(),
                message: "no answer within 5s (fake)".into(),
            });
        }
        Ok(if h.processes.contains_key(&vm.pid) {
            VmState::Running
        } else {
            VmState::Gone
        })
    }

    /// Never waits, stalled or not: a process-table lookup.
    fn ended(&self, vm: &RunningVm) -> Result<Option<VmState>, BackendError> {
        let mut h = self.0.state();
        h.ended_calls += 1;
        Ok((!h.processes.contains_key(&vm.pid)).then_some(VmState::Gone))
    }

    fn stop(&self, vm: &RunningVm, _grace: Duration) -> Result<ExitReason, BackendError> {
        let mut h = self.0.state();
        let wedged = h.unresponsive.remove(&vm.pid);
        match h.processes.remove(&vm.pid) {
            Some(_) if wedged => Ok(ExitReason::Signaled { signal: 9 }),
            Some(_) => Ok(ExitReason::Stopped),
            None => Err(BackendError::NotRunning(ExitReason::Signaled { signal: 9 })),
        }
    }

    fn kill(&self, vm: &RunningVm) -> Result<(), BackendError> {
        self.0.state().processes.remove(&vm.pid);
        Ok(())
    }

    /// What the test set in [`FakeHostState::disk_counters`], while the fake process runs.
    /// A stalled process answers nothing: the call waits out `timeout` (or until the
    /// process is no longer stalled) and fails, counted in
    /// [`FakeHostState::disk_counters_most_waiting`].
    fn disk_counters(
        &self,
        vm: &RunningVm,
        timeout: Duration,
    ) -> Result<Option<crate::backend::DiskCounters>, BackendError> {
        if self.0.state().stalled.contains(&vm.pid) {
            {
                let mut h = self.0.state();
                h.disk_counters_waiting += 1;
                h.disk_counters_most_waiting =
                    h.disk_counters_most_waiting.max(h.disk_counters_waiting);
            }
            let until = std::time::Instant::now() + timeout;
            while self.0.state().stalled.contains(&vm.pid) && std::time::Instant::now() < until {
                std::thread::sleep(Duration::from_millis(5));
            }
            self.0.state().disk_counters_waiting -= 1;
            return Err(BackendError::Control {
                path: PathBuf::from("fake-control.sock"),
                message: format!("no answer within {timeout:?}"),
            });
        }
        let h = self.0.state();
        if !h.processes.contains_key(&vm.pid) {
            return Ok(None);
        }
        Ok(h.disk_counters.get(&vm.tenant).copied())
    }

    /// The fake host runs no guest: nothing listens there unless a test binds it.
    fn agent_endpoint(&self, vm: &RunningVm) -> AgentEndpoint {
        if let Some(cid) = vm.vsock_cid {
            return AgentEndpoint::vhost_vsock(cid);
        }
        if self.0.state().agent_vsock {
            AgentEndpoint::HybridVsock {
                path: vm.tenant_dir.join("run/fake-vsock.sock"),
                port: tenantvm_agent_protocol::AGENT_VSOCK_PORT,
            }
        } else {
            AgentEndpoint::Serial(vm.tenant_dir.join("run/fake-agent.sock"))
        }
    }

    fn agent_transport(&self) -> &'static str {
        let h = self.0.state();
        if h.vhost_vsock {
            "vhost-vsock"
        } else if h.agent_vsock {
            "hybrid-vsock"
        } else {
            "virtio-serial"
        }
    }

    fn needs_vsock_cid(&self) -> bool {
        self.0.state().vhost_vsock
    }
}

/// A fake jail cleaner over [`FakeHost`].
pub struct FakeJail(pub FakeHost);

impl JailCleaner for FakeJail {
    fn cleanup(&self, tenant: &str, _tenant_dir: &Path) -> Result<(), JailError> {
        let mut h = self.0.state();
        h.processes.retain(|_, t| t != tenant);
        h.cgroups.remove(tenant);
        Ok(())
    }

    fn list(&self) -> Result<Vec<String>, JailError> {
        Ok(self.0.state().cgroups.iter().cloned().collect())
    }

    fn limit_block_io(
        &self,
        tenant: &str,
        disks: &[std::path::PathBuf],
        limit: crate::jail::BlockIoLimit,
    ) -> Result<Vec<crate::jail::BlockIoOutcome>, JailError> {
        self.0
            .state()
            .block_io
            .push((tenant.to_string(), disks.to_vec(), limit));
        Ok(disks
            .iter()
            .map(|d| crate::jail::BlockIoOutcome::NotLimited {
                disk: d.clone(),
                reason: "fake host".into(),
            })
            .collect())
    }
}

/// A fake planner: `gpus` GPUs of 8 slots; whole = 8 slots, profile `Ng.*` = N slots (7g =
/// 8), model requests = 2 slots; first fit around the held shares.
pub struct FakeGpus {
    /// GPU count.
    pub gpus: u32,
    /// Placement labels whose (simulated) scrub fails.
    pub fail_scrub: Arc<Mutex<BTreeSet<String>>>,
}

impl Placement for FakeGpus {
    fn place(
        &self,
        _tenant: &str,
        request: &GpuRequest,
        held: &[GpuPlacement],
    ) -> Result<GpuPlacement, GpuError> {
        let len = match (&request.profile, request.whole_gpu) {
            (_, true) => 8,
            (Some(profile), false) => match profile
                .split('g')
                .next()
                .and_then(|n| n.parse::<u32>().ok())
            {
                Some(7) => 8,
                Some(n @ 1..=4) => n,
                _ => return Err(plan_err(format!("unknown profile {profile:?}"))),
            },
            (None, false) => 2,
        };
        for g in 0..self.gpus {
            let gpu = format!("fake-gpu-{g}");
            let mut start = 0;
            while start + len <= 8 {
                let slots: Vec<u32> = (start..start + len).collect();
                let taken = held
                    .iter()
                    .any(|h| h.gpu == gpu && h.slots.iter().any(|s| slots.contains(s)));
                if !taken {
                    return Ok(GpuPlacement {
                        gpu,
                        slots,
                        label: format!("{len}@{start}"),
                    });
                }
                start += len;
            }
        }
        Err(plan_err(
            "every GPU placement that fits the request is taken (fake host)",
        ))
    }
}

impl DeviceRoute for FakeGpus {}

impl Describe for FakeGpus {}

impl Cleaning for FakeGpus {
    fn reset(&self, _placement: &GpuPlacement) -> Result<crate::gpu::DeviceResetOutcome, GpuError> {
        Ok(crate::gpu::DeviceResetOutcome {
            method: "simulated: fake planner".into(),
            result: crate::receipt::StepResult::Ok,
            assurance: crate::receipt::Assurance::Simulated,
            evidence: Default::default(),
        })
    }

    fn scrub(&self, placement: &GpuPlacement) -> Result<crate::gpu::scrub::ScrubOutcome, GpuError> {
        let fail = self.fail_scrub.lock().unwrap().contains(&placement.label);
        Ok(crate::gpu::scrub::simulate_scrub(
            &placement.label,
            1 << 30,
            fail,
        ))
    }
}

/// A service over a fake host in a temp dir, with a named image `hello`.
pub struct Harness {
    /// Keeps the temp dir alive.
    pub dir: tempfile::TempDir,
    /// The fake host.
    pub host: FakeHost,
    /// The service.
    pub svc: TenantService,
    /// Placement labels whose fake scrub fails.
    pub fail_scrub: Arc<Mutex<BTreeSet<String>>>,
    /// How long await-running waits (2 s unless a test needs a long wait).
    pub boot_timeout: Duration,
    /// The GPU planner, when not the [`FakeGpus`] one.
    pub planner: Option<Arc<dyn GpuHost>>,
}

impl Harness {
    /// The admin token, made on first use in the harness's state directory (as the daemon
    /// makes it at init).
    pub fn admin_token(&self) -> String {
        let path = crate::auth::ensure_admin_token(self.svc.store(), self.dir.path())
            .unwrap()
            .expect("the store has no admin token yet");
        std::fs::read_to_string(path).unwrap().trim().to_string()
    }

    /// The departure receipts the audit log holds for tenant `name`, oldest first.
    pub fn receipts_of(&self, name: &str) -> Vec<crate::receipt::LogEntry> {
        let kit = self.svc.departure_kit().unwrap();
        kit.log
            .entries()
            .unwrap()
            .into_iter()
            .filter(|e| e.receipt.tenant == name)
            .collect()
    }

    /// Step `step` of tenant `name`'s first departure receipt (the test fails without one).
    pub fn departure_step(
        &self,
        name: &str,
        step: crate::receipt::DepartureStep,
    ) -> crate::receipt::StepRecord {
        let receipt = self
            .receipts_of(name)
            .into_iter()
            .next()
            .unwrap_or_else(|| panic!("no departure receipt for {name}"))
            .receipt;
        receipt
            .steps
            .into_iter()
            .find(|s| s.step == step)
            .unwrap_or_else(|| panic!("{name}'s receipt has no {step:?} step"))
    }

    /// A fresh harness.
    pub fn new(fault: FaultHook) -> Harness {
        let dir = tempfile::tempdir().unwrap();
        let images = dir.path().join("images/hello");
        std::fs::create_dir_all(&images).unwrap();
        std::fs::write(images.join("kernel"), b"not really a kernel").unwrap();
        let host = FakeHost::default();
        let fail_scrub = Arc::default();
        let boot_timeout = Duration::from_secs(2);
        let svc = Self::service(dir.path(), &host, &fail_scrub, boot_timeout, None, fault);
        Harness {
            dir,
            host,
            svc,
            fail_scrub,
            boot_timeout,
            planner: None,
        }
    }

    /// The same harness with another GPU planner (a new service over the same store).
    pub fn with_planner(mut self, planner: Arc<dyn GpuHost>) -> Harness {
        self.planner = Some(planner);
        self.restart(FaultHook::default());
        self
    }

    /// A new service over the same store file and host: a daemon restart.
    pub fn restart(&mut self, fault: FaultHook) {
        self.svc.wait_idle();
        self.svc = Self::service(
            self.dir.path(),
            &self.host,
            &self.fail_scrub,
            self.boot_timeout,
            self.planner.clone(),
            fault,
        );
    }

    /// The same harness with another boot timeout (a new service over the same store).
    pub fn with_boot_timeout(mut self, boot_timeout: Duration) -> Harness {
        self.boot_timeout = boot_timeout;
        self.restart(FaultHook::default());
        self
    }

    fn service(
        root: &Path,
        host: &FakeHost,
        fail_scrub: &Arc<Mutex<BTreeSet<String>>>,
        boot_timeout: Duration,
        planner: Option<Arc<dyn GpuHost>>,
        fault: FaultHook,
    ) -> TenantService {
        let store = Arc::new(Store::open(&root.join("state.db")).unwrap());
        let mut cfg = ServiceConfig::new(root.join("state"));
        cfg.image_dir = Some(root.join("images"));
        cfg.boot_timeout = boot_timeout;
        // Uids of this test process only: a real daemon on the same machine starts at
        // 200000, and checks that attribute host processes by uid (verify's departure
        // check) must not see its processes as this harness's leftovers.
        cfg.uid_first = 1_000_000 + (std::process::id() % 50_000) * 1024;
        cfg.uid_count = 1024;
        cfg.departure.kek = crate::keys::KekSource::File(root.join("host-kek"));
        cfg.departure.keyslot_cost = crate::disk::KeyslotCost::TEST;
        // A fake host, roomy enough for every test's tenants.
        cfg.capacity = crate::tenant::admission::HostCapacity::fixed(64 * 1024, 64);
        TenantService::new(
            store,
            Arc::new(FakeBackend(host.clone())),
            Arc::new(FakeJail(host.clone())),
            planner.unwrap_or_else(|| {
                Arc::new(FakeGpus {
                    gpus: 1,
                    fail_scrub: fail_scrub.clone(),
                })
            }),
            cfg,
        )
        .with_fault_hook(fault)
    }
}
