//! The simulated GPU host: a JSON file that describes GPUs (model, PCI address, MIG mode,
//! existing instances and which of them are in use). For CI and demos only; chosen with
//! `--gpu-backend sim:FILE`. Every change is written back to the file (under an exclusive
//! `flock` on a lock file in the temporary directory; the file is replaced atomically), so
//! separate commands see one host.
//!
//! It enforces the hardware's rules through the same [`Layout`] the planner uses: overlap and
//! maximum count give `InsufficientResources`, a disallowed start gives `InvalidPlacement`,
//! destroying an instance in use or switching MIG mode with instances gives `InUse`.
//!
//! ```json
//! {"gpus": [{"index": 0, "model": "h100-80gb", "pci_address": "0000:18:00.0",
//!            "mig_enabled": true,
//!            "instances": [{"gi_id": 1, "profile": "3g.40gb", "start": 0, "in_use": true}]}]}
//! ```

use std::fs::File;
use std::io::Write as _;
use std::os::fd::AsRawFd;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use super::{BackendError, GpuBackend, GpuInfo, GpuInstance};
use crate::mig::{self, GpuModel, Layout, PlacementError};

/// The file's contents.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SimHost {
    /// The GPUs.
    pub gpus: Vec<SimGpu>,
}

/// One simulated GPU.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SimGpu {
    /// Index on the host.
    pub index: u32,
    /// Database model key (`h100-80gb`).
    pub model: String,
    /// PCI address.
    pub pci_address: String,
    /// Whether MIG is enabled.
    #[serde(default)]
    pub mig_enabled: bool,
    /// Whether the GPU is passed through whole.
    #[serde(default)]
    pub assigned_whole: bool,
    /// IOMMU group.
    #[serde(default)]
    pub iommu_group: Option<u32>,
    /// Existing GPU instances.
    #[serde(default)]
    pub instances: Vec<SimInstance>,
}

/// One simulated GPU instance.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SimInstance {
    /// GPU-instance id.
    pub gi_id: u32,
    /// Profile name (`3g.40gb`).
    pub profile: String,
    /// Start slot.
    pub start: u32,
    /// Whether a client uses it (destroy is refused).
    #[serde(default)]
    pub in_use: bool,
}

impl SimGpu {
    fn model(&self) -> Result<&'static GpuModel, String> {
        mig::model_by_key(&self.model).map_err(|e| e.to_string())
    }

    fn layout(&self) -> Result<Layout, String> {
        let model = self.model()?;
        let mut l = Layout::empty();
        l.whole = self.assigned_whole;
        for i in &self.instances {
            let p = model.profile(&i.profile).map_err(|e| e.to_string())?;
            l.place(p, i.start)
                .map_err(|e| format!("GPU {} instance {}: {e}", self.index, i.gi_id))?;
        }
        Ok(l)
    }
}

impl SimHost {
    /// Checks models, profiles, placements, unique indexes and instance ids.
    pub fn validate(&self) -> Result<(), String> {
        let mut indexes = std::collections::HashSet::new();
        for g in &self.gpus {
            if !indexes.insert(g.index) {
                return Err(format!("GPU index {} appears twice", g.index));
            }
            g.layout()?;
            if !g.instances.is_empty() && (!g.mig_enabled || g.assigned_whole) {
                return Err(format!(
                    "GPU {} has instances but MIG is off or it is assigned whole",
                    g.index
                ));
            }
            let mut ids = std::collections::HashSet::new();
            if let Some(i) = g.instances.iter().find(|i| !ids.insert(i.gi_id)) {
                return Err(format!(
                    "GPU {} has two instances with id {}",
                    g.index, i.gi_id
                ));
            }
        }
        Ok(())
    }

    fn gpu_mut(&mut self, index: u32) -> Result<&mut SimGpu, BackendError> {
        self.gpus
            .iter_mut()
            .find(|g| g.index == index)
            .ok_or(BackendError::NoSuchGpu(index))
    }
}

/// The simulated backend.
#[derive(Debug)]
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

impl SimBackend {
    /// Opens and validates a simulated host file.
    pub fn open(path: &Path) -> Result<Self, BackendError> {
        let b = SimBackend {
            path: path.to_path_buf(),
        };
        b.with_host(|_| Ok(false))?;
        Ok(b)
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

    /// Runs `f` on the host under the lock; writes the file back when `f` returns true.
    fn with_host<T>(
        &self,
        f: impl FnOnce(&mut SimHost) -> Result<T, BackendError>,
    ) -> Result<T, BackendError>
    where
        T: WriteBack,
    {
        let _lock = FileLock::take(&self.lock_path())
            .map_err(|e| self.file_error(format!("cannot lock: {e}")))?;
        let text = std::fs::read_to_string(&self.path)
            .map_err(|e| self.file_error(format!("cannot read: {e}")))?;
        let mut host: SimHost = serde_json::from_str(&text)
            .map_err(|e| self.file_error(format!("not a simulated host: {e}")))?;
        host.validate().map_err(|e| self.file_error(e))?;
        let out = f(&mut host)?;
        if out.changed() {
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
            Ok(Changed)
        })
        .map(|_| ())
    }
}

/// Whether a closure changed the host (so the file must be written).
trait WriteBack {
    fn changed(&self) -> bool;
}
impl WriteBack for bool {
    fn changed(&self) -> bool {
        *self
    }
}
struct Changed;
impl WriteBack for Changed {
    fn changed(&self) -> bool {
        true
    }
}
struct Unchanged<T>(T);
impl<T> WriteBack for Unchanged<T> {
    fn changed(&self) -> bool {
        false
    }
}
impl WriteBack for GpuInstance {
    fn changed(&self) -> bool {
        true
    }
}

fn model_of(g: &SimGpu) -> Result<&'static GpuModel, BackendError> {
    mig::model_by_key(&g.model).map_err(|_| BackendError::MigUnsupported(g.index))
}

impl GpuBackend for SimBackend {
    fn kind(&self) -> &'static str {
        "sim"
    }

    fn gpus(&self) -> Result<Vec<GpuInfo>, BackendError> {
        self.with_host(|h| {
            let mut out = Vec::new();
            for g in &h.gpus {
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
                        }
                    })
                    .collect();
                out.push(GpuInfo {
                    index: g.index,
                    name: model.name.to_string(),
                    model: Some(model.key),
                    pci_address: g.pci_address.clone(),
                    pci_device_id: model.pci_device_ids[0],
                    memory_mib: model.memory_mib,
                    mig_enabled: g.mig_enabled,
                    assigned_whole: g.assigned_whole,
                    iommu_group: g.iommu_group,
                    instances,
                });
            }
            Ok(Unchanged(out))
        })
        .map(|u| u.0)
    }

    fn set_mig_mode(&self, gpu: u32, enabled: bool) -> Result<(), BackendError> {
        self.with_host(|h| {
            let g = h.gpu_mut(gpu)?;
            if !g.instances.is_empty() || g.assigned_whole {
                return Err(BackendError::InUse {
                    gpu,
                    detail: "GPU instances or a whole-GPU assignment exist".into(),
                });
            }
            g.mig_enabled = enabled;
            Ok(Changed)
        })
        .map(|_| ())
    }

    fn possible_placements(
        &self,
        gpu: u32,
        profile_id: u32,
    ) -> Result<Vec<(u32, u32)>, BackendError> {
        self.with_host(|h| {
            let g = h.gpu_mut(gpu)?;
            let p = model_of(g)?
                .profile_by_id(profile_id)
                .ok_or(BackendError::UnknownProfile {
                    gpu,
                    profile: profile_id,
                })?;
            Ok(Unchanged(p.starts.iter().map(|s| (*s, p.size)).collect()))
        })
        .map(|u| u.0)
    }

    fn remaining_capacity(&self, gpu: u32, profile_id: u32) -> Result<u32, BackendError> {
        self.with_host(|h| {
            let g = h.gpu_mut(gpu)?;
            let model = model_of(g)?;
            let p = model
                .profile_by_id(profile_id)
                .ok_or(BackendError::UnknownProfile {
                    gpu,
                    profile: profile_id,
                })?;
            if !g.mig_enabled {
                return Ok(Unchanged(0));
            }
            // Greedy fill from the lowest free start is what NVML counts.
            let mut l = g.layout().map_err(|e| BackendError::SimFile {
                path: String::new(),
                detail: e,
            })?;
            let mut n = 0;
            while let Some(s) = l.free_starts(p).first().copied() {
                l.place(p, s).expect("free start");
                n += 1;
            }
            Ok(Unchanged(n))
        })
        .map(|u| u.0)
    }

    fn create_instance(
        &self,
        gpu: u32,
        profile_id: u32,
        start: u32,
    ) -> Result<GpuInstance, BackendError> {
        self.with_host(|h| {
            let g = h.gpu_mut(gpu)?;
            let model = model_of(g)?;
            if !g.mig_enabled {
                return Err(BackendError::MigDisabled(gpu));
            }
            let p = model
                .profile_by_id(profile_id)
                .ok_or(BackendError::UnknownProfile {
                    gpu,
                    profile: profile_id,
                })?;
            let layout = g.layout().map_err(|e| BackendError::SimFile {
                path: String::new(),
                detail: e,
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
            });
            Ok(GpuInstance {
                gi_id,
                profile_id,
                start,
                size: p.size,
            })
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
            g.instances.remove(pos);
            Ok(Changed)
        })
        .map(|_| ())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn host_file(dir: &Path, body: &str) -> PathBuf {
        let p = dir.join("host.json");
        std::fs::write(&p, body).unwrap();
        p
    }

    const TWO_H100: &str = r#"{"gpus": [
        {"index": 0, "model": "h100-80gb", "pci_address": "0000:18:00.0", "mig_enabled": true,
         "instances": [{"gi_id": 1, "profile": "3g.40gb", "start": 0, "in_use": true}]},
        {"index": 1, "model": "h100-80gb", "pci_address": "0000:2a:00.0"}]}"#;

    #[test]
    fn overlap_is_insufficient_resources_and_bad_start_is_invalid() {
        let dir = tempfile::tempdir().unwrap();
        let b = SimBackend::open(&host_file(dir.path(), TWO_H100)).unwrap();
        let e = b.create_instance(0, 14, 2).unwrap_err();
        assert!(
            matches!(e, BackendError::InsufficientResources { gpu: 0, .. }),
            "{e}"
        );
        let e = b.create_instance(0, 14, 5).unwrap_err();
        assert!(matches!(e, BackendError::InvalidPlacement { .. }), "{e}");
        let gi = b.create_instance(0, 14, 4).unwrap();
        assert_eq!((gi.gi_id, gi.start, gi.size), (2, 4, 2));
        assert_eq!(
            b.remaining_capacity(0, 19).unwrap(),
            1,
            "only slot 6 is a free 1g start"
        );
    }

    #[test]
    fn destroy_in_use_is_refused_and_changes_persist_across_opens() {
        let dir = tempfile::tempdir().unwrap();
        let path = host_file(dir.path(), TWO_H100);
        let b = SimBackend::open(&path).unwrap();
        let e = b.destroy_instance(0, 1).unwrap_err();
        assert!(matches!(e, BackendError::InUse { .. }), "{e}");
        b.set_in_use(0, 1, false).unwrap();
        b.destroy_instance(0, 1).unwrap();
        assert!(matches!(
            b.destroy_instance(0, 1),
            Err(BackendError::NoSuchInstance { .. })
        ));
        let again = SimBackend::open(&path).unwrap();
        assert!(again.gpus().unwrap()[0].instances.is_empty());
    }

    #[test]
    fn mig_mode_rules_follow_the_hardware() {
        let dir = tempfile::tempdir().unwrap();
        let b = SimBackend::open(&host_file(dir.path(), TWO_H100)).unwrap();
        assert!(matches!(
            b.create_instance(1, 19, 0),
            Err(BackendError::MigDisabled(1))
        ));
        assert!(matches!(
            b.set_mig_mode(0, false),
            Err(BackendError::InUse { .. })
        ));
        b.set_mig_mode(1, true).unwrap();
        b.create_instance(1, 0, 0).unwrap();
        assert_eq!(b.possible_placements(1, 9).unwrap(), vec![(0, 4), (4, 4)]);
        assert!(matches!(
            b.possible_placements(1, 77),
            Err(BackendError::UnknownProfile { .. })
        ));
        assert_eq!(b.gpus().unwrap().len(), 2);
        assert!(matches!(
            b.create_instance(7, 0, 0),
            Err(BackendError::NoSuchGpu(7))
        ));
    }

    #[test]
    fn invalid_files_are_refused_with_the_reason() {
        let dir = tempfile::tempdir().unwrap();
        for (body, want) in [
            ("{", "not a simulated host"),
            (
                r#"{"gpus":[{"index":0,"model":"h999","pci_address":"x"}]}"#,
                "Unknown GPU model",
            ),
            (
                r#"{"gpus":[{"index":0,"model":"h100-80gb","pci_address":"x","mig_enabled":true,
                  "instances":[{"gi_id":1,"profile":"4g.40gb","start":0},{"gi_id":2,"profile":"1g.10gb","start":3}]}]}"#,
                "overlap",
            ),
            (
                r#"{"gpus":[{"index":0,"model":"h100-80gb","pci_address":"x"},{"index":0,"model":"h100-80gb","pci_address":"y"}]}"#,
                "twice",
            ),
        ] {
            let e = SimBackend::open(&host_file(dir.path(), body)).unwrap_err();
            assert!(e.to_string().contains(want), "{e}");
        }
        let e = SimBackend::open(&dir.path().join("missing.json")).unwrap_err();
        assert!(e.to_string().contains("cannot read"), "{e}");
    }
}
