//! The NVML backend: the live host. nvml-wrapper for inventory and MIG mode; the raw
//! nvml-wrapper-sys functions (through `Nvml::lib()`) for what the wrapper lacks or gets
//! wrong: GPU/compute-instance create and destroy, possible placements (the wrapper's
//! `possible_placements` never sets the vector's length) and remaining capacity.
//!
//! libnvidia-ml.so.1 is loaded at run time, so this builds and links without a driver; on a
//! host without one [`NvmlBackend::new`] returns `NvmlUnavailable`.
//!
//! NVML enumerates the GPUs when its session opens: a card unbound from its driver (handed
//! whole to a VM) and bound back is not the same device to a session opened before, and the
//! indexes of the others shift. The daemon calls [`GpuBackend::rescan`] after each bind and
//! rebind, which closes the session and opens a new one (every call holds the session for
//! its duration, so none runs on handles of a closed one). A card NVML cannot read is left
//! out of the inventory with a warning; the others are listed.

use std::mem::MaybeUninit;
use std::sync::{PoisonError, RwLock};

use nvml_wrapper::Nvml;
use nvml_wrapper_sys::bindings as sys;

use super::{BackendError, GpuBackend, GpuInfo, GpuInstance, SliceUsage, UsageSource};
use crate::host::{vgpu_support, PciAddress, Sysfs};
use crate::mig::{self, ReportedProfile, VgpuSupport};

/// The live-host backend.
pub struct NvmlBackend {
    /// The NVML session: replaced by [`GpuBackend::rescan`]; `None` after a reopen that
    /// failed (the next call opens one).
    session: RwLock<Option<Nvml>>,
}

/// Turns an NVML return code into a backend error for GPU `gpu`.
fn check(call: &'static str, gpu: u32, code: sys::nvmlReturn_t) -> Result<(), BackendError> {
    match code {
        sys::nvmlReturn_enum_NVML_SUCCESS => Ok(()),
        sys::nvmlReturn_enum_NVML_ERROR_INSUFFICIENT_RESOURCES => Err(BackendError::InsufficientResources {
            gpu,
            detail: format!("{call}: the slots overlap an existing instance or the profile is at its maximum"),
        }),
        sys::nvmlReturn_enum_NVML_ERROR_IN_USE => Err(BackendError::InUse { gpu, detail: call.to_string() }),
        sys::nvmlReturn_enum_NVML_ERROR_NO_PERMISSION => Err(BackendError::NoPermission),
        sys::nvmlReturn_enum_NVML_ERROR_INVALID_ARGUMENT => {
            Err(BackendError::InvalidPlacement { gpu, detail: format!("{call}: invalid argument") })
        }
        other => Err(BackendError::Nvml { call, detail: format!("return code {other}") }),
    }
}

fn wrapper_error(call: &'static str, gpu: u32, e: nvml_wrapper::error::NvmlError) -> BackendError {
    use nvml_wrapper::error::NvmlError as E;
    match e {
        E::InUse => BackendError::InUse {
            gpu,
            detail: call.to_string(),
        },
        E::NoPermission => BackendError::NoPermission,
        E::NotSupported => BackendError::MigUnsupported(gpu),
        other => BackendError::Nvml {
            call,
            detail: other.to_string(),
        },
    }
}

/// Compute-instance profile enum that spans a GPU instance of `slices` compute slices.
fn ci_profile_for(slices: u32) -> Option<u32> {
    Some(match slices {
        1 => sys::NVML_COMPUTE_INSTANCE_PROFILE_1_SLICE,
        2 => sys::NVML_COMPUTE_INSTANCE_PROFILE_2_SLICE,
        3 => sys::NVML_COMPUTE_INSTANCE_PROFILE_3_SLICE,
        4 => sys::NVML_COMPUTE_INSTANCE_PROFILE_4_SLICE,
        6 => sys::NVML_COMPUTE_INSTANCE_PROFILE_6_SLICE,
        7 => sys::NVML_COMPUTE_INSTANCE_PROFILE_7_SLICE,
        8 => sys::NVML_COMPUTE_INSTANCE_PROFILE_8_SLICE,
        _ => return None,
    })
}

/// NVML's bus id (`00000000:18:00.0`, 32-bit domain) as sysfs writes it (`0000:18:00.0`).
fn sysfs_address(bus_id: &str) -> String {
    let lower = bus_id.trim().to_ascii_lowercase();
    match lower.split_once(':') {
        Some((domain, rest)) if domain.len() > 4 => {
            format!("{}:{rest}", &domain[domain.len() - 4..])
        }
        _ => lower,
    }
}

fn open_session() -> Result<Nvml, BackendError> {
    Nvml::init().map_err(|e| BackendError::NvmlUnavailable(e.to_string()))
}

/// An inventory: the cards read, and those that could not be (index, why).
pub type Inventory<T> = (Vec<T>, Vec<(u32, BackendError)>);

/// The cards of an inventory of `count`, each read by `card`: a card that cannot be read
/// is left out and reported (index, error), so that one unreachable card does not hide the
/// others. Only when every card fails is the inventory an error.
pub fn collect_cards<T>(
    count: u32,
    mut card: impl FnMut(u32) -> Result<T, BackendError>,
) -> Result<Inventory<T>, BackendError> {
    let (mut cards, mut unreachable) = (Vec::new(), Vec::new());
    for index in 0..count {
        match card(index) {
            Ok(c) => cards.push(c),
            Err(e) => unreachable.push((index, e)),
        }
    }
    if cards.is_empty() && !unreachable.is_empty() {
        return Err(unreachable.swap_remove(0).1);
    }
    Ok((cards, unreachable))
}

fn handle(nvml: &Nvml, gpu: u32) -> Result<sys::nvmlDevice_t, BackendError> {
    let dev = nvml
        .device_by_index(gpu)
        .map_err(|_| BackendError::NoSuchGpu(gpu))?;
    // SAFETY: the handle stays valid while the session `nvml` is open, which the caller
    // holds for its whole call; we only pass it back to NVML functions of that session.
    Ok(unsafe { dev.handle() })
}

impl NvmlBackend {
    /// Loads NVML.
    pub fn new() -> Result<Self, BackendError> {
        Ok(NvmlBackend {
            session: RwLock::new(Some(open_session()?)),
        })
    }

    /// Runs `f` on the open session (opening one if a reopen failed before), holding it
    /// for the call: a rescan waits until `f` is done.
    fn with_nvml<T>(
        &self,
        f: impl FnOnce(&Nvml) -> Result<T, BackendError>,
    ) -> Result<T, BackendError> {
        {
            let session = self.session.read().unwrap_or_else(PoisonError::into_inner);
            if let Some(nvml) = session.as_ref() {
                return f(nvml);
            }
        }
        let mut session = self.session.write().unwrap_or_else(PoisonError::into_inner);
        if session.is_none() {
            *session = Some(open_session()?);
        }
        match session.as_ref() {
            Some(nvml) => f(nvml),
            None => Err(BackendError::NvmlUnavailable("no NVML session".into())),
        }
    }

    /// Every GPU-instance profile the GPU reports, with its possible placements.
    pub fn profiles(&self, gpu: u32) -> Result<Vec<ReportedProfile>, BackendError> {
        self.with_nvml(|nvml| profiles(nvml, gpu))
    }
}

/// Every GPU-instance profile the GPU reports, with its possible placements.
fn profiles(nvml: &Nvml, gpu: u32) -> Result<Vec<ReportedProfile>, BackendError> {
    let dev = nvml
        .device_by_index(gpu)
        .map_err(|_| BackendError::NoSuchGpu(gpu))?;
    let mut out = Vec::new();
    for e in 0..sys::NVML_GPU_INSTANCE_PROFILE_COUNT {
        let Ok(info) = dev.profile_info(e) else {
            continue;
        };
        let placements = possible_placements(nvml, gpu, info.id)?;
        out.push(ReportedProfile {
            id: info.id,
            name: format!(
                "{}g.{}gb",
                info.slice_count,
                info.memory_size_mb.div_ceil(1024)
            ),
            compute_slices: info.slice_count,
            memory_mib: info.memory_size_mb,
            placements,
        });
    }
    Ok(out)
}

/// The raw profile info for a profile id (searching the profile enums).
fn profile_info(
    nvml: &Nvml,
    gpu: u32,
    profile_id: u32,
) -> Result<nvml_wrapper::struct_wrappers::device::ProfileInfo, BackendError> {
    let dev = nvml
        .device_by_index(gpu)
        .map_err(|_| BackendError::NoSuchGpu(gpu))?;
    (0..sys::NVML_GPU_INSTANCE_PROFILE_COUNT)
        .filter_map(|e| dev.profile_info(e).ok())
        .find(|i| i.id == profile_id)
        .ok_or(BackendError::UnknownProfile {
            gpu,
            profile: profile_id,
        })
}

fn instances(
    nvml: &Nvml,
    gpu: u32,
) -> Result<Vec<(sys::nvmlGpuInstance_t, GpuInstance)>, BackendError> {
    let lib = nvml.lib();
    let device = handle(nvml, gpu)?;
    let mut out = Vec::new();
    let dev = nvml
        .device_by_index(gpu)
        .map_err(|_| BackendError::NoSuchGpu(gpu))?;
    for e in 0..sys::NVML_GPU_INSTANCE_PROFILE_COUNT {
        let Ok(info) = dev.profile_info(e) else {
            continue;
        };
        let mut handles: Vec<sys::nvmlGpuInstance_t> =
            vec![std::ptr::null_mut(); info.instance_count.max(1) as usize];
        let mut count: u32 = 0;
        // SAFETY: `handles` has room for `instance_count` handles, the most NVML returns
        // for this profile; `count` receives how many it wrote.
        let code = unsafe {
            lib.nvmlDeviceGetGpuInstances(device, info.id, handles.as_mut_ptr(), &mut count)
        };
        check("nvmlDeviceGetGpuInstances", gpu, code)?;
        for h in handles.into_iter().take(count as usize) {
            let gi = gi_info(nvml, gpu, h)?;
            out.push((
                h,
                GpuInstance {
                    gi_id: gi.id,
                    profile_id: gi.profileId,
                    start: gi.placement.start,
                    size: gi.placement.size,
                    has_compute_instance: !compute_instances(nvml, gpu, h)?.is_empty(),
                },
            ));
        }
    }
    Ok(out)
}

/// The GPU instance with id `gi_id`.
fn gi_by_id(nvml: &Nvml, gpu: u32, gi_id: u32) -> Result<sys::nvmlGpuInstance_t, BackendError> {
    let lib = nvml.lib();
    let device = handle(nvml, gpu)?;
    let mut gi: sys::nvmlGpuInstance_t = std::ptr::null_mut();
    // SAFETY: valid device handle and out-pointer.
    let code = unsafe { lib.nvmlDeviceGetGpuInstanceById(device, gi_id, &mut gi) };
    if code == sys::nvmlReturn_enum_NVML_ERROR_NOT_FOUND
        || code == sys::nvmlReturn_enum_NVML_ERROR_INVALID_ARGUMENT
    {
        return Err(BackendError::NoSuchInstance { gpu, gi: gi_id });
    }
    check("nvmlDeviceGetGpuInstanceById", gpu, code)?;
    Ok(gi)
}

fn gi_info(
    nvml: &Nvml,
    gpu: u32,
    gi: sys::nvmlGpuInstance_t,
) -> Result<sys::nvmlGpuInstanceInfo_t, BackendError> {
    let mut info = MaybeUninit::<sys::nvmlGpuInstanceInfo_t>::zeroed();
    // SAFETY: `gi` is a live GPU instance handle; `info` is a sized out-struct.
    let code = unsafe { nvml.lib().nvmlGpuInstanceGetInfo(gi, info.as_mut_ptr()) };
    check("nvmlGpuInstanceGetInfo", gpu, code)?;
    // SAFETY: NVML filled the struct on success (and it was zeroed before).
    Ok(unsafe { info.assume_init() })
}

/// Compute-instance profile `ci_enum` (shared engines) of GPU instance `gi`, or NVML's
/// return code when it has none.
fn ci_profile(
    nvml: &Nvml,
    gi: sys::nvmlGpuInstance_t,
    ci_enum: u32,
) -> Result<sys::nvmlComputeInstanceProfileInfo_t, sys::nvmlReturn_t> {
    let mut ci_info = MaybeUninit::<sys::nvmlComputeInstanceProfileInfo_t>::zeroed();
    // SAFETY: `gi` is a live GPU instance handle; `ci_info` is a sized out-struct.
    let code = unsafe {
        nvml.lib().nvmlGpuInstanceGetComputeInstanceProfileInfo(
            gi,
            ci_enum,
            sys::NVML_COMPUTE_INSTANCE_ENGINE_PROFILE_SHARED,
            ci_info.as_mut_ptr(),
        )
    };
    if code != sys::nvmlReturn_enum_NVML_SUCCESS {
        return Err(code);
    }
    // SAFETY: filled by NVML on success (and zeroed before).
    Ok(unsafe { ci_info.assume_init() })
}

/// Every compute instance of a GPU instance, of every compute-instance profile.
fn compute_instances(
    nvml: &Nvml,
    gpu: u32,
    gi: sys::nvmlGpuInstance_t,
) -> Result<Vec<sys::nvmlComputeInstance_t>, BackendError> {
    let lib = nvml.lib();
    let mut out = Vec::new();
    for ci_enum in 0..sys::NVML_COMPUTE_INSTANCE_PROFILE_COUNT {
        let Ok(ci_info) = ci_profile(nvml, gi, ci_enum) else {
            continue;
        };
        let mut cis: Vec<sys::nvmlComputeInstance_t> =
            vec![std::ptr::null_mut(); ci_info.instanceCount.max(1) as usize];
        let mut count = 0u32;
        // SAFETY: `cis` has room for `instanceCount` handles.
        let code = unsafe {
            lib.nvmlGpuInstanceGetComputeInstances(gi, ci_info.id, cis.as_mut_ptr(), &mut count)
        };
        check("nvmlGpuInstanceGetComputeInstances", gpu, code)?;
        out.extend(cis.into_iter().take(count as usize));
    }
    Ok(out)
}

/// Placements `(start, size)` the profile allows on the GPU.
fn possible_placements(
    nvml: &Nvml,
    gpu: u32,
    profile_id: u32,
) -> Result<Vec<(u32, u32)>, BackendError> {
    let lib = nvml.lib();
    if lib.nvmlDeviceGetGpuInstancePossiblePlacements_v2.is_err() {
        return Err(BackendError::Nvml {
            call: "nvmlDeviceGetGpuInstancePossiblePlacements_v2",
            detail: "missing from this driver".into(),
        });
    }
    let device = handle(nvml, gpu)?;
    let mut count: u32 = 0;
    // SAFETY: a null placements pointer asks NVML only for the count.
    let code = unsafe {
        lib.nvmlDeviceGetGpuInstancePossiblePlacements_v2(
            device,
            profile_id,
            std::ptr::null_mut(),
            &mut count,
        )
    };
    check("nvmlDeviceGetGpuInstancePossiblePlacements_v2", gpu, code)?;
    let mut buf = vec![sys::nvmlGpuInstancePlacement_t { start: 0, size: 0 }; count as usize];
    // SAFETY: `buf` holds `count` placements, the number NVML just reported.
    let code = unsafe {
        lib.nvmlDeviceGetGpuInstancePossiblePlacements_v2(
            device,
            profile_id,
            buf.as_mut_ptr(),
            &mut count,
        )
    };
    check("nvmlDeviceGetGpuInstancePossiblePlacements_v2", gpu, code)?;
    buf.truncate(count as usize);
    Ok(buf.into_iter().map(|p| (p.start, p.size)).collect())
}

/// One card of the inventory.
fn card(
    nvml: &Nvml,
    sysfs: &Sysfs,
    driver_major: Option<u32>,
    index: u32,
) -> Result<GpuInfo, BackendError> {
    let dev = nvml
        .device_by_index(index)
        .map_err(|e| wrapper_error("nvmlDeviceGetHandleByIndex", index, e))?;
    let pci = dev
        .pci_info()
        .map_err(|e| wrapper_error("nvmlDeviceGetPciInfo", index, e))?;
    let device_id = (pci.pci_device_id >> 16) as u16;
    let model = mig::model_by_pci_device(device_id);
    let mig_enabled = dev.mig_mode().is_ok_and(|m| m.current == 1);
    let instances = if mig_enabled {
        instances(nvml, index)?
            .into_iter()
            .map(|(_, i)| i)
            .collect()
    } else {
        Vec::new()
    };
    let address = sysfs_address(&pci.bus_id);
    Ok(GpuInfo {
        index,
        name: dev.name().unwrap_or_default(),
        model: model.map(|m| m.key),
        pci_address: address.clone(),
        pci_device_id: device_id,
        memory_mib: dev.memory_info().map_or(0, |m| m.total / (1024 * 1024)),
        mig_enabled,
        assigned_whole: false,
        iommu_group: PciAddress::parse(&address)
            .ok()
            .and_then(|a| sysfs.device(&a).ok())
            .and_then(|d| d.iommu_group),
        driver_major,
        vgpu: PciAddress::parse(&address)
            .map(|a| vgpu_support(sysfs, &a))
            .unwrap_or(VgpuSupport::Missing {
                reason: format!("NVML reports an unreadable PCI address {address}"),
            }),
        instances,
    })
}

impl GpuBackend for NvmlBackend {
    fn kind(&self) -> &'static str {
        "nvml"
    }

    fn gpus(&self) -> Result<Vec<GpuInfo>, BackendError> {
        self.with_nvml(|nvml| {
            let sysfs = Sysfs::new("/");
            let driver_major = nvml
                .sys_driver_version()
                .ok()
                .and_then(|v| v.split('.').next()?.parse().ok());
            let n = nvml
                .device_count()
                .map_err(|e| wrapper_error("nvmlDeviceGetCount", 0, e))?;
            let (cards, unreachable) =
                collect_cards(n, |index| card(nvml, &sysfs, driver_major, index))?;
            for (index, error) in unreachable {
                tracing::warn!(gpu = index, %error, "NVML cannot read this GPU: left out of the inventory");
            }
            Ok(cards)
        })
    }

    fn rescan(&self) -> Result<(), BackendError> {
        let mut session = self.session.write().unwrap_or_else(PoisonError::into_inner);
        // Closed first: NVML enumerates the GPUs only when no session of the process is open.
        *session = None;
        *session = Some(open_session()?);
        Ok(())
    }

    fn set_mig_mode(&self, gpu: u32, enabled: bool) -> Result<(), BackendError> {
        self.with_nvml(|nvml| {
            let dev = nvml
                .device_by_index(gpu)
                .map_err(|_| BackendError::NoSuchGpu(gpu))?;
            dev.set_mig_mode(enabled)
                .map(|_| ())
                .map_err(|e| wrapper_error("nvmlDeviceSetMigMode", gpu, e))
        })
    }

    fn possible_placements(
        &self,
        gpu: u32,
        profile_id: u32,
    ) -> Result<Vec<(u32, u32)>, BackendError> {
        self.with_nvml(|nvml| possible_placements(nvml, gpu, profile_id))
    }

    fn remaining_capacity(&self, gpu: u32, profile_id: u32) -> Result<u32, BackendError> {
        self.with_nvml(|nvml| {
            let lib = nvml.lib();
            let device = handle(nvml, gpu)?;
            let mut count: u32 = 0;
            // SAFETY: `count` is a valid out-pointer; the device handle is live.
            let code = unsafe {
                lib.nvmlDeviceGetGpuInstanceRemainingCapacity(device, profile_id, &mut count)
            };
            check("nvmlDeviceGetGpuInstanceRemainingCapacity", gpu, code)?;
            Ok(count)
        })
    }

    fn create_gpu_instance(
        &self,
        gpu: u32,
        profile_id: u32,
        start: u32,
    ) -> Result<GpuInstance, BackendError> {
        self.with_nvml(|nvml| {
            let lib = nvml.lib();
            let device = handle(nvml, gpu)?;
            let placement = sys::nvmlGpuInstancePlacement_t { start, size: 0 };
            let mut gi: sys::nvmlGpuInstance_t = std::ptr::null_mut();
            // SAFETY: `placement` and `gi` are valid for the call; NVML reads the first and
            // writes the handle into the second.
            let code = unsafe {
                lib.nvmlDeviceCreateGpuInstanceWithPlacement(
                    device, profile_id, &placement, &mut gi,
                )
            };
            check("nvmlDeviceCreateGpuInstanceWithPlacement", gpu, code)?;
            let info = gi_info(nvml, gpu, gi)?;
            Ok(GpuInstance {
                gi_id: info.id,
                profile_id,
                start: info.placement.start,
                size: info.placement.size,
                has_compute_instance: false,
            })
        })
    }

    fn ensure_compute_instance(&self, gpu: u32, gi_id: u32) -> Result<(), BackendError> {
        self.with_nvml(|nvml| {
            let lib = nvml.lib();
            let gi = gi_by_id(nvml, gpu, gi_id)?;
            if !compute_instances(nvml, gpu, gi)?.is_empty() {
                return Ok(());
            }
            let info = gi_info(nvml, gpu, gi)?;
            let slices = profile_info(nvml, gpu, info.profileId)?.slice_count;
            let ci_enum = ci_profile_for(slices).ok_or(BackendError::UnknownProfile {
                gpu,
                profile: info.profileId,
            })?;
            let call = "nvmlGpuInstanceGetComputeInstanceProfileInfo";
            let ci_info = ci_profile(nvml, gi, ci_enum).map_err(|code| {
                check(call, gpu, code).err().unwrap_or(BackendError::Nvml {
                    call,
                    detail: format!("return code {code}"),
                })
            })?;
            let mut ci: sys::nvmlComputeInstance_t = std::ptr::null_mut();
            // SAFETY: valid GPU instance and out-pointer.
            let code = unsafe { lib.nvmlGpuInstanceCreateComputeInstance(gi, ci_info.id, &mut ci) };
            check("nvmlGpuInstanceCreateComputeInstance", gpu, code)
        })
    }

    fn destroy_instance(&self, gpu: u32, gi_id: u32) -> Result<(), BackendError> {
        self.with_nvml(|nvml| {
            let lib = nvml.lib();
            let gi = gi_by_id(nvml, gpu, gi_id)?;
            for ci in compute_instances(nvml, gpu, gi)? {
                // SAFETY: `ci` was just returned by NVML for this GPU instance.
                let code = unsafe { lib.nvmlComputeInstanceDestroy(ci) };
                check("nvmlComputeInstanceDestroy", gpu, code)?;
            }
            // SAFETY: `gi` is a live GPU instance handle with no compute instances left.
            let code = unsafe { lib.nvmlGpuInstanceDestroy(gi) };
            check("nvmlGpuInstanceDestroy", gpu, code)
        })
    }

    /// A whole GPU: its memory and utilisation (`nvmlDeviceGetMemoryInfo_v2`,
    /// `nvmlDeviceGetUtilizationRates`). A GPU instance: the memory of its MIG device
    /// (found by GPU-instance id); NVML gives no utilisation for a MIG device, so none. A GPU
    /// bound to vfio-pci for a VM is invisible to NVML: an error, and the caller reports
    /// nothing.
    fn usage(&self, gpu: u32, gi_id: Option<u32>) -> Result<Option<SliceUsage>, BackendError> {
        self.with_nvml(|nvml| usage(nvml, gpu, gi_id))
    }
}

fn usage(nvml: &Nvml, gpu: u32, gi_id: Option<u32>) -> Result<Option<SliceUsage>, BackendError> {
    let dev = nvml
        .device_by_index(gpu)
        .map_err(|e| wrapper_error("nvmlDeviceGetHandleByIndex", gpu, e))?;
    let Some(gi_id) = gi_id else {
        let memory = dev
            .memory_info()
            .map_err(|e| wrapper_error("nvmlDeviceGetMemoryInfo", gpu, e))?;
        let busy = dev.utilization_rates().ok().map(|u| u.gpu);
        return Ok(Some(SliceUsage {
            memory_used_bytes: memory.used,
            memory_total_bytes: memory.total,
            utilization_percent: busy,
            source: UsageSource::Nvml,
        }));
    };
    let max = dev
        .mig_device_count()
        .map_err(|e| wrapper_error("nvmlDeviceGetMaxMigDeviceCount", gpu, e))?;
    for i in 0..max {
        let Ok(mig) = dev.mig_device_by_index(i) else {
            continue;
        };
        let mut id = 0u32;
        // SAFETY: `mig` is a live MIG device handle from NVML; `id` is an out-integer.
        let code = unsafe { nvml.lib().nvmlDeviceGetGpuInstanceId(mig.handle(), &mut id) };
        if code != sys::nvmlReturn_enum_NVML_SUCCESS || id != gi_id {
            continue;
        }
        let memory = mig
            .memory_info()
            .map_err(|e| wrapper_error("nvmlDeviceGetMemoryInfo", gpu, e))?;
        return Ok(Some(SliceUsage {
            memory_used_bytes: memory.used,
            memory_total_bytes: memory.total,
            utilization_percent: None,
            source: UsageSource::Nvml,
        }));
    }
    Err(BackendError::NoSuchInstance { gpu, gi: gi_id })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn nvml_return_codes_map_to_the_backend_errors() {
        check("x", 0, sys::nvmlReturn_enum_NVML_SUCCESS).unwrap();
        assert!(matches!(
            check(
                "x",
                1,
                sys::nvmlReturn_enum_NVML_ERROR_INSUFFICIENT_RESOURCES
            ),
            Err(BackendError::InsufficientResources { gpu: 1, .. })
        ));
        assert!(matches!(
            check("x", 0, sys::nvmlReturn_enum_NVML_ERROR_IN_USE),
            Err(BackendError::InUse { .. })
        ));
        assert!(matches!(
            check("x", 0, sys::nvmlReturn_enum_NVML_ERROR_NO_PERMISSION),
            Err(BackendError::NoPermission)
        ));
        assert_eq!(
            ci_profile_for(3),
            Some(sys::NVML_COMPUTE_INSTANCE_PROFILE_3_SLICE)
        );
        assert_eq!(ci_profile_for(5), None);
        assert_eq!(sysfs_address("00000000:18:00.0"), "0000:18:00.0");
        assert_eq!(sysfs_address("0000:DB:00.0"), "0000:db:00.0");
    }

    /// One card NVML cannot read (a lost GPU, one mid-rebind) is left out and reported;
    /// the others are listed. Only an inventory of which no card reads is an error.
    #[test]
    fn one_unreachable_card_does_not_fail_the_inventory() {
        let read = |index: u32| match index {
            1 => Err(BackendError::Nvml {
                call: "nvmlDeviceGetPciInfo",
                detail: "GPU is lost".into(),
            }),
            i => Ok(i),
        };
        let (cards, unreachable) = collect_cards(3, read).unwrap();
        assert_eq!(cards, [0, 2]);
        assert_eq!(unreachable.len(), 1);
        assert_eq!(unreachable[0].0, 1);
        assert!(unreachable[0].1.to_string().contains("lost"));
        // No card read: the inventory fails, with the first card's error.
        let none = collect_cards(2, |i| Err::<u32, _>(BackendError::NoSuchGpu(i)));
        assert!(matches!(none, Err(BackendError::NoSuchGpu(0))));
        // No card at all is an empty inventory, not an error.
        assert!(collect_cards(0, Ok).unwrap().0.is_empty());
    }

    /// Runs against a real GPU only when TENANTVM_TEST_GPU names one (an index); reads the
    /// profiles and placements and compares them with the database.
    #[test]
    fn live_gpu_profiles_match_the_database() {
        let Ok(idx) = std::env::var("TENANTVM_TEST_GPU") else {
            tenantvm_skip::skip!("TENANTVM_TEST_GPU is not set (an NVIDIA GPU index)");
        };
        let gpu: u32 = idx.parse().expect("TENANTVM_TEST_GPU must be a GPU index");
        let b = NvmlBackend::new().expect("NVML loads where TENANTVM_TEST_GPU is set");
        let info = b
            .gpus()
            .unwrap()
            .into_iter()
            .find(|g| g.index == gpu)
            .expect("the GPU exists");
        let Some(model) = info.gpu_model() else {
            tenantvm_skip::skip!("GPU {gpu} ({}) has no MIG entry in the database", info.name);
        };
        let reported = b.profiles(gpu).unwrap();
        assert!(!reported.is_empty(), "a MIG-capable GPU reports profiles");
        let diffs = model.check_against(&reported);
        eprintln!("{} vs NVML: {diffs:#?}", model.key);
        // Geometry must match; memory figures of unconfirmed models are only reported.
        let geometry: Vec<&String> = diffs.iter().filter(|d| d.contains("placements")).collect();
        assert!(geometry.is_empty(), "{geometry:#?}");
        assert!(
            reported.iter().any(|r| r.id == 19),
            "the 1g profile is reported"
        );
    }
}
