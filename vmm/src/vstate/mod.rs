//! KVM state: the VM, its guest memory and its vCPUs.

pub mod cpuid;
pub mod regs;
pub mod vcpu;
pub mod vm;

/// Why KVM state could not be set up.
#[derive(Debug, thiserror::Error)]
pub enum VstateError {
    /// /dev/kvm cannot be opened.
    #[error(
        "Cannot open /dev/kvm: {0}; check that the host has hardware virtualisation \
         enabled, the kvm module is loaded and this user may open /dev/kvm"
    )]
    KvmUnavailable(#[source] kvm_ioctls::Error),
    /// The vCPU count is above what KVM allows here.
    #[error(
        "{requested} vCPUs requested, but KVM on this host allows at most {max}; lower --vcpus"
    )]
    TooManyVcpus {
        /// vCPUs asked for.
        requested: u32,
        /// KVM's limit (and the platform's).
        max: u32,
    },
    /// A KVM ioctl failed.
    #[error("KVM failed to {what}: {source}")]
    Kvm {
        /// What the VMM was doing.
        what: &'static str,
        /// The ioctl's error.
        source: kvm_ioctls::Error,
    },
    /// Guest memory could not be created or written.
    #[error("{0}")]
    Memory(String),
}

/// Shorthand for wrapping a KVM ioctl error with what the VMM was doing.
pub(crate) fn kvm_err(what: &'static str) -> impl FnOnce(kvm_ioctls::Error) -> VstateError {
    move |source| VstateError::Kvm { what, source }
}
