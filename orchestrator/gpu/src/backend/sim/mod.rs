//! The SIMULATED GPU host: a JSON file that describes GPUs (model, PCI address, MIG mode,
//! existing instances and which of them are in use). For CI and demos only; chosen with
//! `--gpu-backend sim:FILE`. Every change is written back to the file (under an exclusive
//! `flock` on a lock file in the temporary directory; the file is replaced atomically), so
//! separate commands see one host.
//!
//! It enforces the hardware's rules through the same [`Layout`](crate::mig::layout::Layout) the planner uses: overlap and
//! maximum count give `InsufficientResources`, a disallowed start gives `InvalidPlacement`,
//! destroying an instance in use or switching MIG mode with instances gives `InUse`. With a
//! linked fake sysfs tree ([`crate::host::fake`]) it is also the driver behind the tree's
//! SR-IOV and vGPU files ([`driver`]): enabling VFs wipes every GPU instance, MIG mode cannot
//! change while VFs are enabled, and an instance a vGPU runs on cannot be destroyed.
//!
//! ```json
//! {"gpus": [{"index": 0, "model": "h100-80gb", "pci_address": "0000:18:00.0",
//!            "mig_enabled": true,
//!            "instances": [{"gi_id": 1, "profile": "3g.40gb", "start": 0, "in_use": true}]}]}
//! ```

pub mod driver;
mod file;
pub mod vendor;

use std::fs::File;
use std::io::Write as _;
use std::os::fd::AsRawFd;
use std::path::{Path, PathBuf};

pub use file::{SimGpu, SimHost, SimInstance, SimUsage, SimVgpu};

use super::{BackendError, GpuBackend, GpuInfo, GpuInstance, SliceUsage, UsageSource};
use crate::mig::{GpuModel, PlacementError};

/// The simulated backend.
#[derive(Debug, Clone)]
pub struct SimBackend {
    path: PathBuf,
}

/// Holds an exclusive `flock` until dropped.
struct FileLock(File);

impl FileLock {
    fn take(path: &Path) -> std::io::Result<Self> {
        let f = File::options()
            .create(true)
            .truncate(false)
            .write(true)
            .open(path)?;
        // SAFETY: flock on a file descriptor we own; no memory is passed.
        if unsafe { libc::flock(f.as_raw_fd(), libc::LOCK_EX) } != 0 {
            return Err(std::io::Error::last_os_error());
        }
        Ok(FileLock(f))
    }
}

impl Drop for FileLock {
    fn drop(&mut self) {
        // SAFETY: unlocks the descriptor we locked; closing would unlock it too.
        unsafe { libc::flock(self.0.as_raw_fd(), libc::LOCK_UN) };
    }
}

fn placement_error(gpu: u32, e: PlacementError) -> BackendError {
    match e {
        PlacementError::BadStart { .. } => BackendError::InvalidPlacement {
            gpu,
            detail: e.to_string(),
        },
        _ => BackendError::InsufficientResources {
            gpu,
            detail: e.to_string(),
        },
    }
}

/// Whether a change must be written back.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Save {
    Yes,
    No,
}

impl SimHost {
    fn gpu_mut(&mut self, index: u32) -> Result<&mut SimGpu, BackendError> {
        self.gpus
            .iter_mut()
            .find(|g| g.index == index)
            .ok_or(BackendError::NoSuchGpu(index))
    }
}

impl SimBackend {
    /// Opens and validates a simulated host file.
    pub fn open(path: &Path) -> Result<Self, BackendError> {
        let b = SimBackend {
            path: path.to_path_buf(),
        };
        b.with_host(|_| Ok(((), Save::No)))?;
        Ok(b)
    }

    /// The host file.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The lock file: in the temporary directory, named after the host file's absolute path,
    /// so that locking leaves nothing beside the host file.
    fn lock_path(&self) -> PathBuf {
        use std::hash::{Hash, Hasher};
        let abs = std::fs::canonicalize(&self.path).unwrap_or_else(|_| self.path.clone());
        let mut h = std::collections::hash_map::DefaultHasher::new();
        abs.hash(&mut h);
        std::env::temp_dir().join(format!("tenantvm-sim-{:016x}.lock", h.finish()))
    }

    fn file_error(&self, detail: String) -> BackendError {
        BackendError::SimFile {
            path: self.path.display().to_string(),
            detail,
        }
    }

    /// Runs `f` on the host under the lock; writes the file back when it says so.
    fn with_host<T>(
        &self,
        f: impl FnOnce(&mut SimHost) -> Result<(T, Save), BackendError>,
    ) -> Result<T, BackendError> {
        let _lock = FileLock::take(&self.lock_path())
            .map_err(|e| self.file_error(format!("cannot lock: {e}")))?;
        let text = std::fs::read_to_string(&self.path)
            .map_err(|e| self.file_error(format!("cannot read: {e}")))?;
        let mut host: SimHost = serde_json::from_str(&text)
            .map_err(|e| self.file_error(format!("not a simulated host: {e}")))?;
        host.validate().map_err(|e| self.file_error(e))?;
        let (out, save) = f(&mut host)?;
        if save == Save::Yes {
            let tmp = self.path.with_extension("json.tmp");
            let body =
                serde_json::to_string_pretty(&host).map_err(|e| self.file_error(e.to_string()))?;
            let mut file =
                File::create(&tmp).map_err(|e| self.file_error(format!("cannot write: {e}")))?;
            file.write_all(body.as_bytes())
                .and_then(|_| file.sync_all())
                .and_then(|_| std::fs::rename(&tmp, &self.path))
                .map_err(|e| self.file_error(format!("cannot write: {e}")))?;
        }
        Ok(out)
    }

    /// The host as the file holds it now.
    pub fn snapshot(&self) -> Result<SimHost, BackendError> {
        self.with_host(|h| Ok((h.clone(), Save::No)))
    }

    /// Marks an instance as used or free by a client (a demo's stand-in for a running VM).
    pub fn set_in_use(&self, gpu: u32, gi_id: u32, in_use: bool) -> Result<(), BackendError> {
        self.with_host(|h| {
            let g = h.gpu_mut(gpu)?;
            let i = g
                .instances
                .iter_mut()
                .find(|i| i.gi_id == gi_id)
                .ok_or(BackendError::NoSuchInstance { gpu, gi: gi_id })?;
            i.in_use = in_use;
            Ok(((), Save::Yes))
        })
    }
}

fn model_of(g: &SimGpu) -> Result<&'static GpuModel, BackendError> {
    g.model().map_err(|detail| BackendError::SimFile {
        path: String::new(),
        detail,
    })
}

/// The model of a GPU that must have MIG.
fn mig_model_of(g: &SimGpu) -> Result<&'static GpuModel, BackendError> {
    let m = model_of(g)?;
    if m.has_mig() {
        Ok(m)
    } else {
        Err(BackendError::MigUnsupported(g.index))
    }
}

fn info_of(g: &SimGpu) -> Result<GpuInfo, BackendError> {
    let facts = g.facts().map_err(|detail| BackendError::SimFile {
        path: String::new(),
        detail,
    })?;
    let model = model_of(g)?;
    let instances = g
        .instances
        .iter()
        .map(|i| {
            let p = model.profile(&i.profile).expect("validated on load");
            GpuInstance {
                gi_id: i.gi_id,
                profile_id: p.id,
                start: i.start,
                size: p.size,
                has_compute_instance: i.compute_instance,
            }
        })
        .collect();
    Ok(GpuInfo {
        index: g.index,
        name: model.name.to_string(),
        model: g.model.as_ref().map(|_| model.key),
        pci_address: g.pci_address.clone(),
        pci_device_id: facts.device_id,
        memory_mib: model.memory_mib,
        mig_enabled: g.mig_enabled,
        assigned_whole: g.assigned_whole,
        iommu_group: g.iommu_group,
        driver_major: facts.driver_major,
        vgpu: facts.vgpu,
        instances,
    })
}

impl GpuBackend for SimBackend {
    fn kind(&self) -> &'static str {
        "sim"
    }

    fn gpus(&self) -> Result<Vec<GpuInfo>, BackendError> {
        self.with_host(|h| {
            let out = h.gpus.iter().map(info_of).collect::<Result<_, _>>()?;
            Ok((out, Save::No))
        })
    }

    fn set_mig_mode(&self, gpu: u32, enabled: bool) -> Result<(), BackendError> {
        self.with_host(|h| {
            let g = h.gpu_mut(gpu)?;
            mig_model_of(g)?;
            if g.mig_enabled == enabled {
                return Ok(((), Save::No));
            }
            if g.sriov_vfs > 0 {
                return Err(BackendError::InUse {
                    gpu,
                    detail: format!(
                        "{} SR-IOV virtual functions are enabled; MIG mode cannot change until they are disabled",
                        g.sriov_vfs
                    ),
                });
            }
            if !g.instances.is_empty() || g.assigned_whole {
                return Err(BackendError::InUse {
                    gpu,
                    detail: "GPU instances or a whole-GPU assignment exist".into(),
                });
            }
            g.mig_enabled = enabled;
            Ok(((), Save::Yes))
        })
    }

    fn possible_placements(
        &self,
        gpu: u32,
        profile_id: u32,
    ) -> Result<Vec<(u32, u32)>, BackendError> {
        self.with_host(|h| {
            let g = h.gpu_mut(gpu)?;
            let p =
                mig_model_of(g)?
                    .profile_by_id(profile_id)
                    .ok_or(BackendError::UnknownProfile {
                        gpu,
                        profile: profile_id,
                    })?;
            Ok((p.starts.iter().map(|s| (*s, p.size)).collect(), Save::No))
        })
    }

    fn remaining_capacity(&self, gpu: u32, profile_id: u32) -> Result<u32, BackendError> {
        self.with_host(|h| {
            let g = h.gpu_mut(gpu)?;
            let p =
                mig_model_of(g)?
                    .profile_by_id(profile_id)
                    .ok_or(BackendError::UnknownProfile {
                        gpu,
                        profile: profile_id,
                    })?;
            if !g.mig_enabled {
                return Ok((0, Save::No));
            }
            // Greedy fill from the lowest free start is what NVML counts.
            let mut l = g.layout().map_err(|detail| BackendError::SimFile {
                path: String::new(),
                detail,
            })?;
            let mut n = 0;
            while let Some(s) = l.free_starts(p).first().copied() {
                l.place(p, s).expect("free start");
                n += 1;
            }
            Ok((n, Save::No))
        })
    }

    fn create_gpu_instance(
        &self,
        gpu: u32,
        profile_id: u32,
        start: u32,
    ) -> Result<GpuInstance, BackendError> {
        self.with_host(|h| {
            let g = h.gpu_mut(gpu)?;
            let model = mig_model_of(g)?;
            if !g.mig_enabled {
                return Err(BackendError::MigDisabled(gpu));
            }
            let p = model
                .profile_by_id(profile_id)
                .ok_or(BackendError::UnknownProfile {
                    gpu,
                    profile: profile_id,
                })?;
            let layout = g.layout().map_err(|detail| BackendError::SimFile {
                path: String::new(),
                detail,
            })?;
            layout
                .check(p, start)
                .map_err(|e| placement_error(gpu, e))?;
            let gi_id = g.instances.iter().map(|i| i.gi_id + 1).max().unwrap_or(1);
            g.instances.push(SimInstance {
                gi_id,
                profile: p.name.to_string(),
                start,
                in_use: false,
                compute_instance: false,
                vgpu_vf: None,
                usage: None,
            });
            let gi = GpuInstance {
                gi_id,
                profile_id,
                start,
                size: p.size,
                has_compute_instance: false,
            };
            Ok((gi, Save::Yes))
        })
    }

    fn ensure_compute_instance(&self, gpu: u32, gi_id: u32) -> Result<(), BackendError> {
        self.with_host(|h| {
            let g = h.gpu_mut(gpu)?;
            let i = g
                .instances
                .iter_mut()
                .find(|i| i.gi_id == gi_id)
                .ok_or(BackendError::NoSuchInstance { gpu, gi: gi_id })?;
            if i.compute_instance {
                return Ok(((), Save::No));
            }
            i.compute_instance = true;
            Ok(((), Save::Yes))
        })
    }

    fn destroy_instance(&self, gpu: u32, gi_id: u32) -> Result<(), BackendError> {
        self.with_host(|h| {
            let g = h.gpu_mut(gpu)?;
            let pos = g
                .instances
                .iter()
                .position(|i| i.gi_id == gi_id)
                .ok_or(BackendError::NoSuchInstance { gpu, gi: gi_id })?;
            if g.instances[pos].in_use {
                return Err(BackendError::InUse {
                    gpu,
                    detail: format!("GPU instance {gi_id} has clients"),
                });
            }
            if let Some(vf) = &g.instances[pos].vgpu_vf {
                return Err(BackendError::InUse {
                    gpu,
                    detail: format!(
                        "GPU instance {gi_id} holds the vGPU of VF {vf}: write 0 to its current_vgpu_type first"
                    ),
                });
            }
            g.instances.remove(pos);
            Ok(((), Save::Yes))
        })
    }

    /// What the file says the GPU or instance uses (nothing when it says nothing), capped
    /// at the slice's memory, labelled [`UsageSource::Simulated`].
    fn usage(&self, gpu: u32, gi_id: Option<u32>) -> Result<Option<SliceUsage>, BackendError> {
        self.with_host(|h| {
            let g = h.gpu_mut(gpu)?;
            let model = model_of(g)?;
            let (total_mib, said) = match gi_id {
                None => (model.memory_mib, g.usage),
                Some(gi) => {
                    let i = g
                        .instances
                        .iter()
                        .find(|i| i.gi_id == gi)
                        .ok_or(BackendError::NoSuchInstance { gpu, gi })?;
                    let p = model
                        .profile(&i.profile)
                        .map_err(|e| BackendError::SimFile {
                            path: String::new(),
                            detail: e.to_string(),
                        })?;
                    (p.memory_mib, i.usage)
                }
            };
            let said = said.unwrap_or_default();
            let usage = SliceUsage {
                memory_used_bytes: said.memory_used_mib.min(total_mib) << 20,
                memory_total_bytes: total_mib << 20,
                utilization_percent: Some(said.utilization_percent),
                source: UsageSource::Simulated,
            };
            Ok((Some(usage), Save::No))
        })
    }
}

#[cfg(test)]
mod tests;
