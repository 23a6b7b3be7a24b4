//! The words the wing's seams speak, shared by every part of it and by its callers: the
//! record of how a share reaches its VM ([`DeviceRecord`]), what a reset and a MIG-mode
//! restore did, and what a tenant was assigned ([`AssignedGpu`]). A leaf: it imports nothing
//! else of the wing.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};
use tenantvm_gpu::host::mdev::MdevAssignment;
use tenantvm_gpu::route::vgpu::{VgpuAttachment, VgpuHost};
use tenantvm_gpu::route::whole::VfioBinding;

use crate::receipt::{Assurance, StepResult};
use crate::store::GpuPlacement;

/// What the host did (or will do) to hand a tenant's share to its VM: stored before the step
/// that acts on it, read by every later step (also after a restart).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "route", rename_all = "snake_case", deny_unknown_fields)]
pub enum DeviceRecord {
    /// Nothing reaches the VM.
    NotAttached {
        /// Why (a simulated host; a route the daemon does not drive yet).
        reason: String,
        /// The card (ledger id) whose MIG mode was off and which this tenant's MIG
        /// instance turns on; the card's last MIG tenant turns it off again as it leaves.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        mig_turned_on: Option<String>,
    },
    /// A whole GPU: its IOMMU group on vfio-pci.
    Whole {
        /// The binding (drivers and overrides before it), to give the group back.
        binding: VfioBinding,
        /// The card was in MIG mode (no instance on it): prepare-gpu-host turns MIG off
        /// before the bind, and release-gpu turns it back on. Recorded before either.
        #[serde(default, skip_serializing_if = "std::ops::Not::not")]
        mig_turned_off: bool,
    },
    /// A MIG instance as an mdev vGPU (vGPU 16 and older); QEMU passes it (`sysfsdev=`).
    MdevVgpu {
        /// The parent device (the GPU).
        parent: String,
        /// The mdev (type and UUID), chosen by bind-gpu once the instance exists and
        /// recorded before it is created.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        assignment: Option<MdevAssignment>,
        /// As for [`DeviceRecord::NotAttached`]: the card whose MIG mode this tenant turns on.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        mig_turned_on: Option<String>,
    },
    /// A MIG instance as the vGPU of an SR-IOV VF.
    SriovVgpu {
        /// The card's preparation (whether this tenant turned MIG and VFs on).
        host: VgpuHost,
        /// The typed VF, once bind-gpu ran.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        attachment: Option<VgpuAttachment>,
    },
}

impl DeviceRecord {
    /// Whether a device is handed to the VM.
    pub fn attaches(&self) -> bool {
        !matches!(self, DeviceRecord::NotAttached { .. })
    }

    /// The card whose MIG mode was off before this tenant and which the daemon turns off
    /// again when the card's last MIG tenant leaves (vGPU: its host's `enables_mig`, for
    /// which the card is the PF).
    pub fn mig_turned_on(&self) -> Option<&str> {
        match self {
            DeviceRecord::NotAttached { mig_turned_on, .. }
            | DeviceRecord::MdevVgpu { mig_turned_on, .. } => mig_turned_on.as_deref(),
            DeviceRecord::SriovVgpu { host, .. } => host.enables_mig.then_some(host.pf.as_str()),
            DeviceRecord::Whole { .. } => None,
        }
    }

    /// Records that this tenant's card `gpu` had MIG off and that its turning it on is this
    /// record's to undo (a whole GPU has no MIG mode to restore: unchanged).
    pub fn take_mig_turned_on(&mut self, gpu: &str) {
        match self {
            DeviceRecord::NotAttached { mig_turned_on, .. }
            | DeviceRecord::MdevVgpu { mig_turned_on, .. } => {
                *mig_turned_on = Some(gpu.to_string());
            }
            DeviceRecord::SriovVgpu { host, .. } => host.enables_mig = true,
            DeviceRecord::Whole { .. } => {}
        }
    }

    /// The route's name, for receipts and logs.
    pub fn route(&self) -> &'static str {
        match self {
            DeviceRecord::NotAttached { .. } => "not-attached",
            DeviceRecord::Whole { .. } => "whole-gpu",
            DeviceRecord::SriovVgpu { .. } => "sriov-vgpu",
            DeviceRecord::MdevVgpu { .. } => "mdev-vgpu",
        }
    }
}

/// What restoring a card's MIG mode did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum MigRestore {
    /// MIG was on and is off now.
    TurnedOff,
    /// MIG was off already (a re-run after a crash).
    AlreadyOff,
    /// MIG stays on, and why (instances the daemon did not make remain).
    LeftOn(String),
}

/// What a device reset did, for the receipt.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DeviceResetOutcome {
    /// How it was done.
    pub method: String,
    /// `ok`, or `skipped` when the device has no reset of its own.
    pub result: StepResult,
    /// How much was checked.
    pub assurance: Assurance,
    /// Device ids and the like.
    pub evidence: BTreeMap<String, String>,
}

/// NVIDIA's PCI vendor id.
pub const NVIDIA_VENDOR: u16 = 0x10de;

/// The GPU share the daemon assigned to a tenant, as far as it knows it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct AssignedGpu {
    /// The card (ledger id: PCI address or index).
    pub gpu: String,
    /// The placement: `whole` or `<profile>@<start>`.
    pub label: String,
    /// How it reaches the VM: `whole-gpu`, `sriov-vgpu`, `mdev-vgpu`, `not-attached`, or
    /// `pending` before the device step recorded it.
    pub route: String,
    /// The card's product name, from the GPU backend.
    pub model: Option<String>,
    /// The MIG profile (absent for a whole card).
    pub mig_profile: Option<String>,
    /// The slice's memory, MiB (the profile's, or the whole card's).
    pub memory_mib: Option<u64>,
    /// What the VM was given on the host: PCI addresses (`DDDD:BB:DD.F`) or an mdev UUID.
    pub host_devices: Vec<String>,
    /// Vendor id the guest should see.
    pub vendor: Option<u16>,
    /// Device id the guest should see (whole card: the host device's own).
    pub device: Option<u16>,
    /// Why nothing reaches the VM, when nothing does.
    pub not_attached: Option<String>,
}

impl AssignedGpu {
    /// What the ledger and the device record alone say: the card, the placement, the
    /// route (`pending` without a record) and why nothing is handed over, if nothing is.
    pub fn basic(placement: &GpuPlacement, record: Option<&DeviceRecord>) -> AssignedGpu {
        AssignedGpu {
            gpu: placement.gpu.clone(),
            label: placement.label.clone(),
            route: record.map_or("pending", DeviceRecord::route).to_string(),
            model: None,
            mig_profile: None,
            memory_mib: None,
            host_devices: Vec::new(),
            vendor: None,
            device: None,
            not_attached: match record {
                Some(DeviceRecord::NotAttached { reason, .. }) => Some(reason.clone()),
                _ => None,
            },
        }
    }

    /// Whether a device is handed to the VM.
    pub fn attaches(&self) -> bool {
        self.not_attached.is_none() && self.route != "pending"
    }
}
