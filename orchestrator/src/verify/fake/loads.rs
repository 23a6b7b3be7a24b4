//! The fake host's in-guest test loads: started, then reported from the time since they
//! started, the guest's RAM and GPU slice, and what [`Broken`](super::Broken) says.

use std::time::{Duration, Instant};

use tenantvm_agent_protocol::{LoadKind, LoadReport, LoadSpec, LoadState};

use super::{refused, FakeVerifyHost};
use crate::domain::lifecycle::LifecycleState;
use crate::verify::host::HostError;

impl FakeVerifyHost {
    /// Starts an in-guest test load, as the agent would (or refuses it, as [`Broken`](super::Broken)
    /// says).
    pub(super) fn start_load(&self, name: &str, spec: LoadSpec) -> Result<(), HostError> {
        let mut st = self.st();
        if !st.tenants.contains_key(name) {
            return Err(refused());
        }
        if self.broken.guest_loads_refused {
            return Err(HostError::Api {
                status: 502,
                message: "the agent answered load with bad-request: unknown variant `load`".into(),
            });
        }
        if self.broken.vmm_killed_by_overrun && spec.kind == LoadKind::Memory {
            if let Some(t) = st.tenants.get_mut(name) {
                t.view.state = LifecycleState::Failed;
            }
            return Ok(());
        }
        st.loads.insert(
            (name.to_string(), spec.kind.as_str()),
            (spec, Instant::now()),
        );
        Ok(())
    }

    /// What a test load did so far: its progress computed from the time since it started,
    /// the guest's size and slice, and [`Broken`](super::Broken).
    pub(super) fn load_status(&self, name: &str, kind: LoadKind) -> Result<LoadReport, HostError> {
        let st = self.st();
        let t = st.tenants.get(name).ok_or_else(refused)?;
        if t.view.state != LifecycleState::Running {
            return Err(HostError::Api {
                status: 409,
                message: format!("Tenant {name:?} is not running"),
            });
        }
        let guest = u64::from(t.view.spec.memory_mib);
        let mut r = LoadReport {
            spec: None,
            state: LoadState::Idle,
            elapsed_ms: 0,
            progress: 0,
            exit_code: None,
            oom_kills: 0,
            guest_mem_total_mib: guest - 8,
            error: None,
        };
        let Some((spec, at)) = st.loads.get(&(name.to_string(), kind.as_str())) else {
            return Ok(r);
        };
        r.spec = Some(*spec);
        r.elapsed_ms = at.elapsed().as_millis() as u64;
        let ran_out = at.elapsed() >= Duration::from_secs(u64::from(spec.seconds));
        match kind {
            LoadKind::Memory
                if self.broken.guest_ram_unbounded || u64::from(spec.amount) < guest =>
            {
                r.state = LoadState::Finished;
                r.exit_code = Some(0);
                r.progress = u64::from(spec.amount);
            }
            LoadKind::GpuMemory if self.broken.no_cuda_in_guest => {
                r.state = LoadState::Failed;
                r.exit_code = Some(1);
                r.error = Some("no CUDA driver in the guest: cannot load libcuda.so.1: libcuda.so.1: cannot open shared object file: No such file or directory".into());
            }
            LoadKind::GpuMemory => {
                let slice_mib = t
                    .view
                    .gpu
                    .as_ref()
                    .and_then(|s| crate::verify::gpu_probe::slice_memory_mib(&self.gpus, s))
                    .unwrap_or(0);
                r.state = LoadState::Finished;
                r.exit_code = Some(0);
                // The driver's own context takes a little of the slice.
                r.progress = if self.broken.gpu_memory_unbounded {
                    u64::from(spec.amount)
                } else {
                    slice_mib.saturating_sub(400)
                };
            }
            LoadKind::GpuCompute if self.broken.no_cuda_in_guest => {
                r.state = LoadState::Failed;
                r.exit_code = Some(1);
                r.error = Some("no CUDA driver in the guest: cannot load libcuda.so.1: libcuda.so.1: cannot open shared object file: No such file or directory".into());
            }
            LoadKind::GpuCompute => {
                let run = at
                    .elapsed()
                    .min(Duration::from_secs(u64::from(spec.seconds)));
                // Another tenant's compute load running during this one's.
                let start = *at;
                let end = start + run;
                let contended = st.loads.iter().any(|((n, k), (s, t))| {
                    n != name
                        && *k == LoadKind::GpuCompute.as_str()
                        && *t < end
                        && *t + Duration::from_secs(u64::from(s.seconds)) > start
                });
                // A slice's own rate: 1000 million multiply-adds per second per block
                // batch, a quarter of it when its compute is shared with a busy neighbour.
                let per_s: u64 = if self.broken.gpu_compute_shared && contended {
                    250
                } else {
                    1000
                };
                r.elapsed_ms = run.as_millis() as u64;
                r.progress = r.elapsed_ms * per_s / 1000 + 1;
                r.state = if ran_out {
                    LoadState::Finished
                } else {
                    LoadState::Running
                };
                r.exit_code = ran_out.then_some(0);
            }
            LoadKind::Memory => {
                r.state = LoadState::Killed;
                r.exit_code = Some(137);
                r.progress = guest - 24;
                r.oom_kills = 1;
            }
            _ => {
                r.state = if ran_out {
                    LoadState::Finished
                } else {
                    LoadState::Running
                };
                r.exit_code = ran_out.then_some(0);
                r.progress = r.elapsed_ms / 10 + 1;
            }
        }
        Ok(r)
    }
}
