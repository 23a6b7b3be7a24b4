//! The SIMULATED NVIDIA driver laid over a real host's PCI functions: a simulated host file
//! places a MIG GPU with SR-IOV (`"vgpu": "sriov"`) at the address of a real SR-IOV physical
//! function (the nested test host: QEMU's NVMe controller with `sriov_max_vfs`), and the
//! daemon runs with `--gpu-sysfs-root /`. Then the MIG-backed vGPU route
//! ([`crate::route::vgpu`]) runs against the real kernel wherever the kernel can answer, and
//! against this driver where only NVIDIA's driver could:
//!
//! - **real**: the PF's `sriov_totalvfs`, enabling and disabling its VFs through
//!   `sriov_numvfs` (the kernel creates and removes the VFs, with their IOMMU groups), the
//!   VFs' `virtfnN` links, and the VF the VMM is given;
//! - **SIMULATED** (this driver, on the simulated host file): MIG mode and the GPU
//!   instances, a VF's `nvidia/` attributes (`creatable_vgpu_types`, `current_vgpu_type`,
//!   `gpu_instance_id`, `placement_id`) with the driver's rules of [`super::driver`] (enabling
//!   VFs wipes the instances; a type starts a vGPU on a free instance of its profile; VFs stay
//!   while a vGPU runs), and the vGPU types themselves (`SIMULATED <model>-<slices>-<GB>C`).
//!
//! A type set on a real VF does what NVIDIA's vGPU manager does for its own VFs before a VM
//! can use them: the GPU's `vf_hook` program, if the file names one, prepares the VF
//! (`HOOK... online PF VF`; the nested host brings the NVMe secondary controller online with
//! nvme-cli's `virt-mgmt`), and the VF is registered with VFIO by binding vfio-pci to it
//! (NVIDIA's driver registers its VFs with VFIO itself; a stand-in VF has no driver that
//! would). Clearing the type undoes both in the reverse order (`... offline PF VF`). The
//! simulated vGPU is started only once the VF is ready and stopped only once the VF is
//! released, so a type read back always means a ready VF, and a crash in between leaves
//! what a re-run of the same write completes (the hook must be idempotent).

use std::io;
use std::path::Path;
use std::process::{Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use super::{SimBackend, SimGpu, SimHost, SimVgpu};
use crate::host::vfio::{rebind, VFIO_DRIVER};
use crate::host::vgpu::vgpu_suffix;
use crate::host::{DriverOverlay, HostDeviceError, PciAddress, Sysfs};

/// How long a `vf_hook` may run before it is killed and the step fails.
pub const HOOK_DEADLINE: Duration = Duration::from_secs(60);

/// The first type id of the simulated vGPU types (id = this + the MIG profile's NVML id).
const TYPE_ID_BASE: u32 = 1000;

/// The SIMULATED NVIDIA driver on a real host's functions (see the module documentation).
#[derive(Debug, Clone)]
pub struct SimulatedVgpuDriver {
    sim: SimBackend,
}

/// What a path under the root names, for this driver.
enum Attr<'a> {
    /// `sys/bus/pci/devices/<pf>/sriov_numvfs`.
    NumVfs(&'a str),
    /// `sys/bus/pci/devices/<vf>/nvidia/<attr>`.
    Vgpu(&'a str, &'a str),
}

fn attr_of<'a>(parts: &'a [String]) -> Option<Attr<'a>> {
    let p: Vec<&str> = parts.iter().map(String::as_str).collect();
    match p.as_slice() {
        ["sys", "bus", "pci", "devices", pf, "sriov_numvfs"] => Some(Attr::NumVfs(pf)),
        ["sys", "bus", "pci", "devices", vf, "nvidia", attr] => Some(Attr::Vgpu(vf, attr)),
        _ => None,
    }
}

fn errno(code: i32, why: &str) -> io::Error {
    tracing::debug!(errno = code, why, "SIMULATED vGPU driver refuses");
    io::Error::from_raw_os_error(code)
}

fn io_of(e: HostDeviceError) -> io::Error {
    match e {
        HostDeviceError::Io { source, .. } => source,
        other => io::Error::other(other.to_string()),
    }
}

fn backend_io(e: crate::backend::BackendError) -> io::Error {
    io::Error::other(e.to_string())
}

/// The simulated vGPU types of a GPU's model: (id, name, MIG profile).
fn types_of(gpu: &SimGpu) -> Vec<(u32, String, &'static str)> {
    let Ok(model) = gpu.model() else {
        return Vec::new();
    };
    model
        .profiles
        .iter()
        .map(|p| {
            (
                TYPE_ID_BASE + p.id,
                format!("SIMULATED {}{}", model.key, vgpu_suffix(p)),
                p.name,
            )
        })
        .collect()
}

impl SimulatedVgpuDriver {
    /// `sysfs` (a real host's, normally `/`) with this driver answering the attributes only
    /// NVIDIA's driver could, for the GPUs of `sim` that sit at real PCI addresses.
    pub fn over(sysfs: Sysfs, sim: SimBackend) -> Sysfs {
        sysfs.with_overlay(Arc::new(SimulatedVgpuDriver { sim }))
    }

    fn host(&self) -> io::Result<SimHost> {
        self.sim.snapshot().map_err(backend_io)
    }

    /// The simulated SR-IOV vGPU GPU at `pf`, if the file has one there.
    fn gpu_at(host: &SimHost, pf: &str) -> Option<SimGpu> {
        host.gpu_at(pf)
            .filter(|g| g.vgpu == SimVgpu::Sriov)
            .cloned()
    }

    /// The instance (gi id, start, profile) whose vGPU `vf` runs, if any.
    fn served(gpu: &SimGpu, vf: &str) -> Option<(u32, u32, String)> {
        gpu.instances
            .iter()
            .find(|i| i.vgpu_vf.as_deref() == Some(vf))
            .map(|i| (i.gi_id, i.start, i.profile.clone()))
    }

    fn read_attr(gpu: &SimGpu, vf: &str, attr: &str) -> io::Result<String> {
        let served = Self::served(gpu, vf);
        let types = types_of(gpu);
        match attr {
            "current_vgpu_type" => Ok(match &served {
                Some((_, _, profile)) => types
                    .iter()
                    .find(|(_, _, p)| p.eq_ignore_ascii_case(profile))
                    .map_or_else(|| "0".into(), |(id, _, _)| id.to_string()),
                None => "0".into(),
            }),
            "creatable_vgpu_types" => {
                let mut out = String::from("ID    : vGPU Name\n");
                if served.is_none() {
                    for (id, name, profile) in &types {
                        let free = gpu.instances.iter().any(|i| {
                            i.vgpu_vf.is_none() && i.profile.eq_ignore_ascii_case(profile)
                        });
                        if free {
                            out.push_str(&format!("{id:<6}: {name}\n"));
                        }
                    }
                }
                Ok(out)
            }
            "gpu_instance_id" | "placement_id" => {
                let (gi, start, _) =
                    served.ok_or_else(|| errno(libc::ENXIO, "no vGPU type is set on the VF"))?;
                Ok(if attr == "gpu_instance_id" { gi } else { start }.to_string())
            }
            _ => Err(errno(libc::ENOENT, "no such attribute")),
        }
    }

    /// `sriov_numvfs = value` on a simulated GPU's real PF: the simulated driver's rules
    /// first (it may refuse, as NVIDIA's would; enabling wipes the instances), then the
    /// kernel's write; if the kernel refuses, the simulated count is put back.
    fn set_vfs(&self, below: &Sysfs, path: &Path, pf: &str, value: &str) -> io::Result<()> {
        let n: u32 = value
            .trim()
            .parse()
            .map_err(|_| errno(libc::EINVAL, "not a count"))?;
        let before = Self::gpu_at(&self.host()?, pf).map_or(0, |g| g.sriov_vfs);
        self.sim
            .driver_set_vfs(pf, n)
            .map_err(|r| errno(r.errno, &r.why))?;
        if let Err(e) = below.write(path, value) {
            if let Err(undo) = self.sim.driver_set_vfs(pf, before) {
                tracing::error!(pf, why = %undo.why, "the simulated VF count could not be put back");
            }
            return Err(io_of(e));
        }
        Ok(())
    }

    /// Runs the GPU's `vf_hook` with `action PF VF`, within [`HOOK_DEADLINE`].
    fn run_hook(gpu: &SimGpu, action: &str, pf: &str, vf: &str) -> io::Result<()> {
        let Some(hook) = &gpu.vf_hook else {
            return Ok(());
        };
        let fail = |why: String| io::Error::other(format!("vf_hook {hook:?} {action} {vf}: {why}"));
        let mut child = Command::new(&hook[0])
            .args(&hook[1..])
            .args([action, pf, vf])
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .map_err(|e| fail(format!("cannot start it: {e}")))?;
        let deadline = Instant::now() + HOOK_DEADLINE;
        let status = loop {
            if let Some(status) = child.try_wait().map_err(|e| fail(e.to_string()))? {
                break status;
            }
            if Instant::now() > deadline {
                let _ = child.kill();
                let _ = child.wait();
                return Err(fail(format!(
                    "still running after {} s: killed",
                    HOOK_DEADLINE.as_secs()
                )));
            }
            std::thread::sleep(Duration::from_millis(20));
        };
        if status.success() {
            tracing::info!(vf, action, "SIMULATED vGPU driver: vf_hook done");
            return Ok(());
        }
        let mut err = String::new();
        if let Some(mut e) = child.stderr.take() {
            let _ = io::Read::read_to_string(&mut e, &mut err);
        }
        let last = err.lines().last().unwrap_or("").trim().to_string();
        Err(fail(format!("{status}: {last}")))
    }

    /// What makes a real VF usable by a VM, undone: VFIO's binding and the hook's setup.
    fn release_vf(below: &Sysfs, gpu: &SimGpu, pf: &str, vf: &PciAddress) -> io::Result<()> {
        let bound = below.device(vf).map_err(io_of)?.driver;
        if bound.as_deref() == Some(VFIO_DRIVER) {
            rebind(below, vf, None, "\n").map_err(io_of)?;
            Self::run_hook(gpu, "offline", pf, vf.as_str())?;
        }
        Ok(())
    }

    /// `current_vgpu_type = value` on a real VF. A type: the VF prepared (hook, VFIO), then
    /// the simulated vGPU started on a free instance of the type's profile. `0`: the VF
    /// released, then the vGPU stopped. See the module documentation for the order.
    fn set_type(
        &self,
        below: &Sysfs,
        gpu: &SimGpu,
        pf: &str,
        vf: &str,
        value: &str,
    ) -> io::Result<()> {
        let id: u32 = value
            .trim()
            .parse()
            .map_err(|_| errno(libc::EINVAL, "not a type id"))?;
        let addr = PciAddress::parse(vf).map_err(io_of)?;
        let served = Self::served(gpu, vf);
        if id == 0 {
            Self::release_vf(below, gpu, pf, &addr)?;
            if served.is_some() {
                self.sim
                    .driver_stop_vgpu(pf, vf)
                    .map_err(|r| errno(r.errno, &r.why))?;
                tracing::info!(vf, "SIMULATED vGPU driver: vGPU stopped");
            }
            return Ok(());
        }
        if served.is_some() {
            return Err(errno(libc::EBUSY, "the VF already has a vGPU type"));
        }
        let Some((_, _, profile)) = types_of(gpu).into_iter().find(|(t, _, _)| *t == id) else {
            return Err(errno(libc::EINVAL, "not a vGPU type of this GPU"));
        };
        let creatable = Self::read_attr(gpu, vf, "creatable_vgpu_types")?;
        if !crate::host::vgpu::parse_creatable(&creatable)
            .iter()
            .any(|t| t.id == id.to_string())
        {
            return Err(errno(
                libc::EINVAL,
                "the type is not creatable on this VF now",
            ));
        }
        let prepared = Self::run_hook(gpu, "online", pf, vf)
            .and_then(|()| rebind(below, &addr, Some(VFIO_DRIVER), VFIO_DRIVER).map_err(io_of))
            .and_then(|()| {
                self.sim
                    .driver_start_vgpu(pf, vf, profile)
                    .map_err(|r| errno(r.errno, &r.why))
            });
        match prepared {
            Ok(i) => {
                tracing::info!(
                    vf,
                    gi = i.gi_id,
                    profile,
                    "SIMULATED vGPU driver: vGPU started on a real VF"
                );
                Ok(())
            }
            Err(e) => {
                if let Err(undo) = Self::release_vf(below, gpu, pf, &addr) {
                    tracing::error!(vf, error = %undo, "releasing the VF after a failed type also failed");
                }
                Err(e)
            }
        }
    }
}

impl DriverOverlay for SimulatedVgpuDriver {
    fn write(&self, below: &Sysfs, path: &Path, value: &str) -> Option<io::Result<()>> {
        let parts = rel_parts(below, path)?;
        match attr_of(&parts)? {
            Attr::NumVfs(pf) => {
                let host = match self.host() {
                    Ok(h) => h,
                    Err(e) => return Some(Err(e)),
                };
                Self::gpu_at(&host, pf)?;
                Some(self.set_vfs(below, path, pf, value))
            }
            Attr::Vgpu(vf, attr) => {
                let (gpu, pf) = match self.owner(below, vf) {
                    Ok(found) => found?,
                    Err(e) => return Some(Err(e)),
                };
                Some(match attr {
                    "current_vgpu_type" => self.set_type(below, &gpu, &pf, vf, value),
                    _ => Err(errno(libc::EACCES, "read-only attribute")),
                })
            }
        }
    }

    fn read(&self, below: &Sysfs, path: &Path) -> Option<io::Result<Vec<u8>>> {
        let parts = rel_parts(below, path)?;
        let Attr::Vgpu(vf, attr) = attr_of(&parts)? else {
            return None;
        };
        let (gpu, _) = match self.owner(below, vf) {
            Ok(found) => found?,
            Err(e) => return Some(Err(e)),
        };
        Some(Self::read_attr(&gpu, vf, attr).map(|v| format!("{v}\n").into_bytes()))
    }

    fn describe(&self) -> String {
        format!(
            "SIMULATED NVIDIA vGPU driver ({}) on this host's real PCI functions",
            self.sim.path().display()
        )
    }
}

impl SimulatedVgpuDriver {
    /// The simulated GPU (and its PF) whose real VF `vf` is; `None`: not one of ours.
    fn owner(&self, below: &Sysfs, vf: &str) -> io::Result<Option<(SimGpu, String)>> {
        let Ok(addr) = PciAddress::parse(vf) else {
            return Ok(None);
        };
        let Some(pf) = below.physfn(&addr) else {
            return Ok(None);
        };
        Ok(Self::gpu_at(&self.host()?, pf.as_str()).map(|g| (g, pf.to_string())))
    }
}

fn rel_parts(sysfs: &Sysfs, path: &Path) -> Option<Vec<String>> {
    Some(
        path.strip_prefix(sysfs.root())
            .ok()?
            .to_string_lossy()
            .split('/')
            .map(str::to_string)
            .collect(),
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::GpuBackend;
    use crate::host::fake::FakeHost;
    use crate::host::vgpu::{vf_state, VgpuError};
    use crate::route::vgpu::{self as route, VgpuRouteError};

    const PF: &str = "0000:00:06.0";

    /// A FAKE kernel standing for the real one below the driver: an SR-IOV PF (QEMU's
    /// NVMe controller, on the nvme driver) with two VFs, and vfio-pci.
    const TREE: &str = r#"{"devices": [{"bdf": "0000:00:06.0", "vendor": "0x8086",
        "device": "0x5845", "class": "0x010802", "driver": "nvme", "iommu_group": 7,
        "sriov_totalvfs": 2}], "drivers": ["vfio-pci", "nvme"], "modules": ["vfio_pci"]}"#;

    struct Setup {
        _dir: tempfile::TempDir,
        tree: FakeHost,
        sim: SimBackend,
        sysfs: Sysfs,
        hook_log: std::path::PathBuf,
    }

    /// The tree, a SIMULATED H100 at the PF's address whose hook logs its calls (and fails
    /// with `hook_fails`), and the tree's sysfs under the simulated driver.
    fn setup(hook_fails: bool) -> Setup {
        let dir = tempfile::tempdir().unwrap();
        let tree = FakeHost::build(&serde_json::from_str(TREE).unwrap()).unwrap();
        let hook_log = dir.path().join("hook.log");
        let script = format!(
            "echo \"$*\" >> {}; {}",
            hook_log.display(),
            if hook_fails {
                "echo 'controller 1: invalid state' >&2; exit 3"
            } else {
                "exit 0"
            }
        );
        let host = serde_json::json!({"gpus": [{"index": 0, "model": "h100-80gb",
            "pci_address": PF, "driver": "570.124.06", "vgpu": "sriov",
            "vf_hook": ["/bin/sh", "-c", script, "hook"]}]});
        let path = dir.path().join("host.json");
        std::fs::write(&path, host.to_string()).unwrap();
        let sim = SimBackend::open(&path).unwrap();
        let sysfs = SimulatedVgpuDriver::over(tree.sysfs(), sim.clone());
        Setup {
            _dir: dir,
            tree,
            sim,
            sysfs,
            hook_log,
        }
    }

    fn hook_calls(s: &Setup) -> Vec<String> {
        std::fs::read_to_string(&s.hook_log)
            .unwrap_or_default()
            .lines()
            .map(str::to_string)
            .collect()
    }

    fn driver_of(s: &Setup, vf: &str) -> Option<String> {
        s.sysfs
            .device(&PciAddress::parse(vf).unwrap())
            .unwrap()
            .driver
    }

    #[test]
    fn the_vgpu_route_runs_on_real_vfs_under_the_simulated_driver() {
        let s = setup(false);
        let pf = PciAddress::parse(PF).unwrap();
        let h100 = crate::mig::model_by_key("h100-80gb").unwrap();
        let profile = h100.profile("1g.10gb").unwrap();
        let gpu = s.sim.gpus().unwrap().remove(0);

        let host = route::plan_host(&s.sysfs, &gpu).unwrap();
        assert!(host.enables_mig && host.enables_vfs, "{host:?}");
        route::prepare_host(&s.sysfs, &s.sim, &host).unwrap();
        // The kernel below made the VFs; the simulated driver counts them too.
        let vfs = crate::host::sriov::vfs(&s.sysfs, &pf);
        assert_eq!(vfs.len(), 2);
        assert_eq!(s.sim.snapshot().unwrap().gpus[0].sriov_vfs, 2);
        assert!(s.sim.gpus().unwrap()[0].mig_enabled);
        // A VF is untyped and offers nothing until the instance exists.
        let st = vf_state(&s.sysfs, &vfs[0]).unwrap();
        assert_eq!((st.vgpu_type, st.gpu_instance_id), (None, None));

        let gi = route::ensure_instance(&s.sim, 0, profile, 4).unwrap();
        let a = route::attach(&s.sysfs, &pf, &gi, profile).unwrap();
        assert_eq!(a.vf, vfs[0].as_str());
        assert_eq!(a.gpu_instance_id, gi.gi_id);
        assert_eq!(a.placement_id, Some(4));
        assert!(
            a.vgpu_type.name.starts_with("SIMULATED h100-80gb-1-10C"),
            "{a:?}"
        );
        // The VF is ready for a VM: prepared by the hook, registered with VFIO.
        assert_eq!(driver_of(&s, &a.vf).as_deref(), Some("vfio-pci"));
        assert_eq!(hook_calls(&s), [format!("online {PF} {}", a.vf)]);
        // Attaching again returns the same VF and does nothing more.
        let again = route::attach(&s.sysfs, &pf, &gi, profile).unwrap();
        assert_eq!(
            (&again.vf, &again.vgpu_type.id, again.gpu_instance_id),
            (&a.vf, &a.vgpu_type.id, a.gpu_instance_id)
        );
        assert_eq!(hook_calls(&s).len(), 1);
        // The driver's rules hold on the real PF: no VF disable while a vGPU runs, and the
        // kernel's count stays.
        let e = crate::host::sriov::disable_vfs(&s.sysfs, &pf).unwrap_err();
        assert!(e.to_string().contains("Device or resource busy"), "{e}");
        assert_eq!(crate::host::sriov::enabled_vfs(&s.sysfs, &pf).unwrap(), 2);

        route::detach_instance(&s.sysfs, &s.sim, 0, profile, 4).unwrap();
        assert_eq!(driver_of(&s, &a.vf), None, "VFIO released the VF");
        let over = s
            .tree
            .sysfs()
            .read(&s.sysfs.device_dir(&vfs[0]).join("driver_override"));
        assert_eq!(over.unwrap(), "(null)");
        assert_eq!(
            hook_calls(&s),
            [
                format!("online {PF} {}", a.vf),
                format!("offline {PF} {}", a.vf)
            ]
        );
        route::destroy_instance(&s.sim, 0, profile, 4).unwrap();
        route::leave_vgpu_mode(&s.sysfs, &s.sim, &host).unwrap();
        assert!(
            crate::host::sriov::vfs(&s.sysfs, &pf).is_empty(),
            "VFs gone"
        );
        let g = &s.sim.snapshot().unwrap().gpus[0];
        assert_eq!((g.sriov_vfs, g.mig_enabled), (0, false));
        assert!(s.sysfs.overlay().unwrap().contains("SIMULATED"));
    }

    #[test]
    fn a_failing_hook_fails_the_type_and_leaves_the_vf_free() {
        let s = setup(true);
        let pf = PciAddress::parse(PF).unwrap();
        let profile = crate::mig::model_by_key("h100-80gb")
            .unwrap()
            .profile("1g.10gb")
            .unwrap();
        let gpu = s.sim.gpus().unwrap().remove(0);
        let host = route::plan_host(&s.sysfs, &gpu).unwrap();
        route::prepare_host(&s.sysfs, &s.sim, &host).unwrap();
        let gi = route::ensure_instance(&s.sim, 0, profile, 4).unwrap();
        let e = route::attach(&s.sysfs, &pf, &gi, profile).unwrap_err();
        assert_eq!(e.step(), route::STEP_SET_TYPE);
        assert!(
            e.to_string().contains("controller 1: invalid state"),
            "the hook's message: {e}"
        );
        let vf = crate::host::sriov::vfs(&s.sysfs, &pf).remove(0);
        assert_eq!(vf_state(&s.sysfs, &vf).unwrap().vgpu_type, None);
        assert_eq!(driver_of(&s, vf.as_str()), None);
        let g = &s.sim.snapshot().unwrap().gpus[0];
        assert!(g.instances.iter().all(|i| i.vgpu_vf.is_none()), "{g:?}");
    }

    #[test]
    fn functions_the_simulated_host_does_not_hold_are_the_kernels() {
        let s = setup(false);
        let pf = PciAddress::parse(PF).unwrap();
        let gpu = s.sim.gpus().unwrap().remove(0);
        route::prepare_host(&s.sysfs, &s.sim, &route::plan_host(&s.sysfs, &gpu).unwrap()).unwrap();
        let vf = crate::host::sriov::vfs(&s.sysfs, &pf).remove(0);
        // Without the driver, the same VF has no vGPU attributes at all (the FAKE kernel's
        // placeholder files aside, a real VF has none): the route cannot run on it.
        let plain = Sysfs::new(s.tree.root());
        std::fs::remove_dir_all(plain.device_dir(&vf).join("nvidia")).unwrap();
        assert!(matches!(
            vf_state(&plain, &vf),
            Err(VgpuError::NotAVgpuVf(_))
        ));
        assert!(vf_state(&s.sysfs, &vf).is_ok(), "the driver answers for it");
        // A host file that no longer places a GPU at the PF: the driver answers nothing.
        std::fs::write(s.sim.path(), r#"{"gpus": []}"#).unwrap();
        assert!(matches!(
            vf_state(&s.sysfs, &vf),
            Err(VgpuError::NotAVgpuVf(_))
        ));
        let e = route::attach(
            &s.sysfs,
            &pf,
            &crate::backend::GpuInstance {
                gi_id: 1,
                profile_id: 19,
                start: 4,
                size: 1,
                has_compute_instance: true,
            },
            crate::mig::model_by_key("h100-80gb")
                .unwrap()
                .profile("1g.10gb")
                .unwrap(),
        )
        .unwrap_err();
        assert!(matches!(e, VgpuRouteError::Vgpu { .. }), "{e}");
    }
}
