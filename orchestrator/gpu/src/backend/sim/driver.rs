//! SIMULATED NVIDIA driver behind a linked fake sysfs tree: the SR-IOV and MIG-backed vGPU
//! rules, acting on the simulated host file. The fake kernel ([`crate::host::fake`]) calls
//! these when a test writes or reads the tree's `sriov_numvfs` and VF `nvidia/*` files, and
//! turns a refusal into the errno the kernel would return.
//!
//! The rules (reported by an implementation that runs MIG-backed vGPU in production):
//! - enabling VFs (`sriov-manage -e`, `sriov_numvfs`) rebinds the GPU and wipes every GPU
//!   instance on it; MIG mode survives;
//! - a VF's `creatable_vgpu_types` lists only types whose MIG profile has a GPU instance that
//!   carries no vGPU yet: empty until such an instance exists;
//! - writing a type picks that instance (the lowest id of the profile, here); the VF's
//!   `gpu_instance_id` and `placement_id` read ENXIO until a type is set;
//! - MIG mode cannot change while VFs are enabled ([`super::SimBackend`]'s `set_mig_mode`), and
//!   an instance a vGPU runs on cannot be destroyed.

use super::{Save, SimBackend, SimHost};
use crate::backend::BackendError;

/// A refusal: the errno the kernel returns and, for the log, why.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DriverRefusal {
    /// `libc::EBUSY`, `libc::EINVAL`, ...
    pub errno: i32,
    /// Why, in words.
    pub why: String,
}

impl DriverRefusal {
    fn new(errno: i32, why: impl Into<String>) -> Self {
        DriverRefusal {
            errno,
            why: why.into(),
        }
    }
}

fn from_backend(e: BackendError) -> DriverRefusal {
    DriverRefusal::new(libc::EIO, e.to_string())
}

/// A GPU instance as a VF sees it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DriverInstance {
    /// GPU-instance id.
    pub gi_id: u32,
    /// Profile name.
    pub profile: String,
    /// Start slot.
    pub start: u32,
    /// The VF whose vGPU runs on it.
    pub vgpu_vf: Option<String>,
}

impl SimBackend {
    fn on_pf<T>(
        &self,
        pf: &str,
        f: impl FnOnce(&mut super::SimGpu) -> Result<(T, Save), DriverRefusal>,
    ) -> Result<T, DriverRefusal> {
        let mut refusal = None;
        let out = self.with_host(|h: &mut SimHost| {
            let Some(g) = h.gpu_at_mut(pf) else {
                refusal = Some(DriverRefusal::new(
                    libc::ENODEV,
                    format!("the simulated host has no GPU at {pf}"),
                ));
                return Ok((None, Save::No));
            };
            match f(g) {
                Ok((v, save)) => Ok((Some(v), save)),
                Err(r) => {
                    refusal = Some(r);
                    Ok((None, Save::No))
                }
            }
        });
        match (out.map_err(from_backend)?, refusal) {
            (Some(v), _) => Ok(v),
            (None, Some(r)) => Err(r),
            (None, None) => unreachable!("a refusal is recorded whenever no value is"),
        }
    }

    /// `sriov_numvfs = n` on the GPU at `pf`. From 0 to n > 0: wipes every GPU instance (MIG
    /// mode stays); refused (EBUSY) while one is in use. Back to 0: refused (EBUSY) while a
    /// vGPU runs on any instance.
    pub fn driver_set_vfs(&self, pf: &str, n: u32) -> Result<(), DriverRefusal> {
        self.on_pf(pf, |g| {
            if n == g.sriov_vfs {
                return Ok(((), Save::No));
            }
            if n > 0 {
                if let Some(i) = g.instances.iter().find(|i| i.in_use) {
                    return Err(DriverRefusal::new(
                        libc::EBUSY,
                        format!(
                            "GPU instance {} has clients; the rebind cannot happen",
                            i.gi_id
                        ),
                    ));
                }
                if !g.instances.is_empty() {
                    tracing::info!(
                        pf,
                        wiped = g.instances.len(),
                        "SIMULATED driver: enabling VFs rebinds the GPU and wipes its GPU instances"
                    );
                }
                g.instances.clear();
            } else if let Some(i) = g.instances.iter().find(|i| i.vgpu_vf.is_some()) {
                return Err(DriverRefusal::new(
                    libc::EBUSY,
                    format!("a vGPU runs on GPU instance {}", i.gi_id),
                ));
            }
            g.sriov_vfs = n;
            Ok(((), Save::Yes))
        })
    }

    /// The GPU instances of the GPU at `pf`.
    pub fn driver_instances(&self, pf: &str) -> Result<Vec<DriverInstance>, DriverRefusal> {
        self.on_pf(pf, |g| {
            let v = g
                .instances
                .iter()
                .map(|i| DriverInstance {
                    gi_id: i.gi_id,
                    profile: i.profile.clone(),
                    start: i.start,
                    vgpu_vf: i.vgpu_vf.clone(),
                })
                .collect();
            Ok((v, Save::No))
        })
    }

    /// Starts the vGPU of `vf` on the lowest-id instance of `profile` that carries none;
    /// returns that instance. EINVAL when there is none (the type is not creatable), EBUSY
    /// when the VF already runs one.
    pub fn driver_start_vgpu(
        &self,
        pf: &str,
        vf: &str,
        profile: &str,
    ) -> Result<DriverInstance, DriverRefusal> {
        self.on_pf(pf, |g| {
            if g.sriov_vfs == 0 {
                return Err(DriverRefusal::new(libc::ENODEV, "no VFs are enabled"));
            }
            if g.instances.iter().any(|i| i.vgpu_vf.as_deref() == Some(vf)) {
                return Err(DriverRefusal::new(
                    libc::EBUSY,
                    format!("{vf} already runs a vGPU"),
                ));
            }
            let Some(i) = g
                .instances
                .iter_mut()
                .filter(|i| i.vgpu_vf.is_none() && i.profile.eq_ignore_ascii_case(profile))
                .min_by_key(|i| i.gi_id)
            else {
                return Err(DriverRefusal::new(
                    libc::EINVAL,
                    format!("no free GPU instance of profile {profile}"),
                ));
            };
            i.vgpu_vf = Some(vf.to_string());
            let out = DriverInstance {
                gi_id: i.gi_id,
                profile: i.profile.clone(),
                start: i.start,
                vgpu_vf: i.vgpu_vf.clone(),
            };
            Ok((out, Save::Yes))
        })
    }

    /// Stops the vGPU of `vf` (type 0). Nothing to do when it runs none.
    pub fn driver_stop_vgpu(&self, pf: &str, vf: &str) -> Result<(), DriverRefusal> {
        self.on_pf(pf, |g| {
            match g
                .instances
                .iter_mut()
                .find(|i| i.vgpu_vf.as_deref() == Some(vf))
            {
                Some(i) => {
                    i.vgpu_vf = None;
                    Ok(((), Save::Yes))
                }
                None => Ok(((), Save::No)),
            }
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::GpuBackend;

    fn host(dir: &std::path::Path) -> SimBackend {
        let p = dir.join("h.json");
        std::fs::write(
            &p,
            r#"{"gpus":[{"index":0,"model":"h100-80gb","pci_address":"0000:18:00.0","mig_enabled":true,
                "vgpu":"sriov","instances":[{"gi_id":1,"profile":"3g.40gb","start":0}]}]}"#,
        )
        .unwrap();
        SimBackend::open(&p).unwrap()
    }

    #[test]
    fn enabling_vfs_wipes_instances_and_mig_mode_survives() {
        let dir = tempfile::tempdir().unwrap();
        let b = host(dir.path());
        b.driver_set_vfs("0000:18:00.0", 16).unwrap();
        let g = &b.gpus().unwrap()[0];
        assert!(g.instances.is_empty(), "wiped");
        assert!(g.mig_enabled, "MIG mode survives");
        // Enabling again changes nothing.
        b.create_instance(0, 9, 4).unwrap();
        b.driver_set_vfs("0000:18:00.0", 16).unwrap();
        assert_eq!(b.gpus().unwrap()[0].instances.len(), 1);
    }

    #[test]
    fn mig_mode_cannot_change_while_vfs_are_enabled() {
        let dir = tempfile::tempdir().unwrap();
        let b = host(dir.path());
        b.driver_set_vfs("0000:18:00.0", 16).unwrap();
        let e = b.set_mig_mode(0, false).unwrap_err();
        assert!(e.to_string().contains("virtual functions"), "{e}");
        b.driver_set_vfs("0000:18:00.0", 0).unwrap();
        b.set_mig_mode(0, false).unwrap();
    }

    #[test]
    fn a_vgpu_takes_the_lowest_free_instance_and_pins_it() {
        let dir = tempfile::tempdir().unwrap();
        let b = host(dir.path());
        let pf = "0000:18:00.0";
        let e = b
            .driver_start_vgpu(pf, "0000:18:00.4", "3g.40gb")
            .unwrap_err();
        assert_eq!(e.errno, libc::ENODEV, "no VFs yet");
        b.driver_set_vfs(pf, 16).unwrap();
        let e = b
            .driver_start_vgpu(pf, "0000:18:00.4", "3g.40gb")
            .unwrap_err();
        assert_eq!(e.errno, libc::EINVAL, "no instance after the wipe");
        let second = b.create_instance(0, 9, 4).unwrap();
        let first = b.create_instance(0, 9, 0).unwrap();
        assert!(first.gi_id > second.gi_id);
        let got = b.driver_start_vgpu(pf, "0000:18:00.4", "3g.40gb").unwrap();
        assert_eq!(
            got.gi_id, second.gi_id,
            "lowest id, not the one created last"
        );
        let e = b.destroy_instance(0, second.gi_id).unwrap_err();
        assert!(e.to_string().contains("current_vgpu_type"), "{e}");
        assert_eq!(
            b.driver_set_vfs(pf, 0).unwrap_err().errno,
            libc::EBUSY,
            "VFs stay while a vGPU runs"
        );
        b.driver_stop_vgpu(pf, "0000:18:00.4").unwrap();
        b.driver_stop_vgpu(pf, "0000:18:00.4").unwrap();
        b.destroy_instance(0, second.gi_id).unwrap();
        assert_eq!(
            b.driver_set_vfs("0000:99:00.0", 1).unwrap_err().errno,
            libc::ENODEV
        );
    }
}
