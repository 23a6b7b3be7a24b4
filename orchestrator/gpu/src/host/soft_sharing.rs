//! GPU sharing without a hardware partition, found on a host: an MPS control daemon, or a
//! VF carrying a time-sliced vGPU type. Neither is an isolation boundary between tenants:
//! MPS clients share one GPU address space and its faults, and time-sliced vGPUs share the
//! whole GPU's memory system and engines, one after the other (docs/verify.md, "When not to
//! build this"). `host check` and `tenantvm verify` (check 2) fail a host where either
//! serves tenant GPUs; both use these functions, so they judge by one rule.
//!
//! A MIG-backed vGPU runs on a GPU instance, and its VF's `nvidia/gpu_instance_id` names it
//! once a type is set. A VF with a type and no GPU instance (the attribute reads ENXIO or is
//! absent) carries a time-sliced vGPU.

use super::{sriov, PciAddress, Sysfs};

/// The process names of NVIDIA's MPS: its control daemon and the server it starts.
pub const MPS_PROCESSES: [&str; 2] = ["nvidia-cuda-mps-control", "nvidia-cuda-mps-server"];

/// One way a GPU is shared without a hardware partition.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum SoftSharing {
    /// An MPS process runs on the host (it serves whichever GPUs it was started on).
    Mps {
        /// Its pid.
        pid: u32,
        /// Its name.
        name: String,
    },
    /// A VF of a GPU carries a vGPU type on no GPU instance: time-sliced.
    TimeSlicedVgpu {
        /// The GPU.
        gpu: String,
        /// The VF.
        vf: String,
        /// Its `current_vgpu_type`.
        vgpu_type: String,
    },
}

impl std::fmt::Display for SoftSharing {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            SoftSharing::Mps { pid, name } => write!(
                f,
                "an MPS process runs ({name}, pid {pid}): MPS clients share one GPU address space, no isolation boundary"
            ),
            SoftSharing::TimeSlicedVgpu { gpu, vf, vgpu_type } => write!(
                f,
                "VF {vf} of GPU {gpu} carries vGPU type {vgpu_type} on no GPU instance: a time-sliced vGPU shares the whole GPU's memory and engines, no isolation boundary"
            ),
        }
    }
}

impl SoftSharing {
    /// What to do about it.
    pub fn fix(&self) -> String {
        match self {
            SoftSharing::Mps { .. } => {
                "stop MPS (`echo quit | nvidia-cuda-mps-control`) and keep it off on tenant hosts; give tenants MIG-backed vGPUs or whole GPUs".into()
            }
            SoftSharing::TimeSlicedVgpu { vf, .. } => format!(
                "stop the VM using {vf} and clear its type (`echo 0 > /sys/bus/pci/devices/{vf}/nvidia/current_vgpu_type`); give tenants MIG-backed vGPU types (`-<slices>-<GB>C`) only"
            ),
        }
    }
}

/// MPS processes on the host (read from `<root>/proc/<pid>/comm`).
pub fn mps_processes(sysfs: &Sysfs) -> Vec<SoftSharing> {
    let proc = sysfs.path("proc");
    sysfs
        .list(&proc)
        .into_iter()
        .filter_map(|entry| {
            let pid: u32 = entry.parse().ok()?;
            let name = std::fs::read_to_string(proc.join(&entry).join("comm")).ok()?;
            let name = name.trim();
            MPS_PROCESSES.contains(&name).then(|| SoftSharing::Mps {
                pid,
                name: name.to_string(),
            })
        })
        .collect()
}

/// The VFs of `gpu` that carry a time-sliced vGPU type.
pub fn time_sliced_vgpus(sysfs: &Sysfs, gpu: &PciAddress) -> Vec<SoftSharing> {
    sriov::vfs(sysfs, gpu)
        .into_iter()
        .filter_map(|vf| {
            let nvidia = sysfs.device_dir(&vf).join("nvidia");
            let vgpu_type = sysfs.read(&nvidia.join("current_vgpu_type")).ok()?;
            if vgpu_type == "0" {
                return None;
            }
            let instance = nvidia.join("gpu_instance_id");
            let on_instance = instance.exists()
                && sysfs
                    .read_unless_enxio(&instance)
                    .ok()
                    .flatten()
                    .is_some_and(|v| !v.is_empty());
            (!on_instance).then(|| SoftSharing::TimeSlicedVgpu {
                gpu: gpu.to_string(),
                vf: vf.to_string(),
                vgpu_type,
            })
        })
        .collect()
}

/// Everything that shares `gpus` without a hardware partition: MPS processes (host-wide)
/// and each GPU's time-sliced vGPUs.
pub fn find(sysfs: &Sysfs, gpus: &[PciAddress]) -> Vec<SoftSharing> {
    let mut found = mps_processes(sysfs);
    for gpu in gpus {
        found.extend(time_sliced_vgpus(sysfs, gpu));
    }
    found
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::host::fake::FakeHost;

    #[test]
    fn an_mps_daemon_is_found_by_its_process_name() {
        let dir = tempfile::tempdir().unwrap();
        let s = Sysfs::new(dir.path());
        for (pid, comm) in [
            (1, "systemd"),
            (77, "nvidia-cuda-mps-control"),
            (78, "bash"),
        ] {
            let p = dir.path().join(format!("proc/{pid}"));
            std::fs::create_dir_all(&p).unwrap();
            std::fs::write(p.join("comm"), format!("{comm}\n")).unwrap();
        }
        // Not a process directory.
        std::fs::create_dir_all(dir.path().join("proc/sys")).unwrap();
        assert_eq!(
            mps_processes(&s),
            [SoftSharing::Mps {
                pid: 77,
                name: "nvidia-cuda-mps-control".into()
            }]
        );
        // The control: none running, none found.
        std::fs::write(dir.path().join("proc/77/comm"), "sleep\n").unwrap();
        assert!(mps_processes(&s).is_empty());
    }

    #[test]
    fn a_typed_vf_on_no_gpu_instance_is_time_sliced() {
        let host = FakeHost::build(&FakeHost::h100x8_spec()).unwrap();
        let s = host.sysfs();
        let gpu = PciAddress::parse("0000:18:00.0").unwrap();
        let vfs = sriov::enable_vfs(&s, &gpu).unwrap();
        // The control: VFs without a type share nothing.
        assert!(time_sliced_vgpus(&s, &gpu).is_empty());
        // A type on a VF whose gpu_instance_id reads ENXIO: no GPU instance under it (the
        // FAKE tree has no simulated driver linked, so no instance serves it).
        let vf = &vfs[0];
        std::fs::write(s.device_dir(vf).join("nvidia/current_vgpu_type"), "1056\n").unwrap();
        let found = find(&s, std::slice::from_ref(&gpu));
        assert_eq!(
            found,
            [SoftSharing::TimeSlicedVgpu {
                gpu: gpu.to_string(),
                vf: vf.to_string(),
                vgpu_type: "1056".into()
            }]
        );
        assert!(found[0].to_string().contains("time-sliced"));
    }
}
