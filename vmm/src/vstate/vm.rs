//! The KVM VM: in-kernel irqchip (PIC + IOAPIC + LAPICs) and PIT, guest memory slots,
//! irqfds.

use kvm_bindings::{
    kvm_pit_config, kvm_userspace_memory_region, CpuId, KVM_MAX_CPUID_ENTRIES,
    KVM_PIT_SPEAKER_DUMMY,
};
use kvm_ioctls::{Kvm, VcpuFd, VmFd};
use tenantvm_vmm_api::HugePages;
use vm_memory::{GuestMemoryBackend, GuestMemoryMmap, GuestMemoryRegion};
use vmm_sys_util::eventfd::EventFd;

use super::{kvm_err, VstateError};
use crate::boot::layout::{KVM_IDENTITY_MAP_ADDRESS, KVM_TSS_ADDRESS};
use crate::boot::mptable::MAX_SUPPORTED_CPUS;

/// The only KVM API version there has ever been.
const KVM_API_VERSION: i32 = 12;

/// Creates the guest's RAM: `size` bytes, split around the 32-bit hole; anonymous
/// memory, or with `hugepages` one hugetlb memfd of that page size (no hugetlbfs mount
/// needed, so a jailed VMM can use it), its pages allocated up front: a host without
/// enough free pages is an error now, never a SIGBUS when the guest first touches one.
pub fn create_guest_memory(
    size: u64,
    hugepages: Option<HugePages>,
) -> Result<GuestMemoryMmap, VstateError> {
    let ranges = crate::boot::layout::ram_ranges(size);
    let Some(pages) = hugepages else {
        let ranges: Vec<_> = ranges
            .into_iter()
            .map(|(start, len)| (vm_memory::GuestAddress(start), len as usize))
            .collect();
        return GuestMemoryMmap::from_ranges(&ranges).map_err(|e| {
            VstateError::Memory(format!(
                "Cannot reserve {} MiB of guest memory ({e}); lower --memory-mib",
                size >> 20
            ))
        });
    };
    let file = hugetlb_memfd(size, pages)?;
    let mut offset = 0u64;
    let mut regions = Vec::with_capacity(ranges.len());
    for (start, len) in ranges {
        let file = file
            .try_clone()
            .map_err(|e| VstateError::Memory(format!("Cannot share the guest RAM file: {e}")))?;
        regions.push((
            vm_memory::GuestAddress(start),
            len as usize,
            Some(vm_memory::FileOffset::new(file, offset)),
        ));
        offset += len;
    }
    GuestMemoryMmap::from_ranges_with_files(regions).map_err(|e| {
        VstateError::Memory(format!(
            "Cannot map {} MiB of guest memory on {pages} huge pages ({e})",
            size >> 20
        ))
    })
}

/// A memfd of `size` bytes on huge pages of `pages`' size, every page allocated.
fn hugetlb_memfd(size: u64, pages: HugePages) -> Result<std::fs::File, VstateError> {
    use std::os::fd::{AsRawFd, FromRawFd};
    let flag = match pages {
        HugePages::Size2M => libc::MFD_HUGE_2MB,
        HugePages::Size1G => libc::MFD_HUGE_1GB,
    };
    // SAFETY: the name is a valid C string; memfd_create only reads it.
    let fd = unsafe {
        libc::memfd_create(
            c"tenantvm-guest-ram".as_ptr(),
            libc::MFD_CLOEXEC | libc::MFD_HUGETLB | flag,
        )
    };
    if fd < 0 {
        return Err(VstateError::Memory(format!(
            "Cannot create a {pages} huge-page file for guest memory ({}); is hugetlb enabled in the host kernel?",
            std::io::Error::last_os_error()
        )));
    }
    // SAFETY: the kernel returned a new descriptor that nothing else owns.
    let file = unsafe { std::fs::File::from_raw_fd(fd) };
    file.set_len(size)
        .map_err(|e| VstateError::Memory(format!("Cannot size the guest RAM file: {e}")))?;
    let len = libc::off_t::try_from(size)
        .map_err(|_| VstateError::Memory(format!("{size} bytes of guest memory is too large")))?;
    // SAFETY: `file` is an open memfd; fallocate touches only its pages.
    if unsafe { libc::fallocate(file.as_raw_fd(), 0, 0, len) } != 0 {
        return Err(VstateError::Memory(format!(
            "Cannot back {} MiB of guest memory with {pages} huge pages: {} of them are needed and the host has not that many free ({}); reserve more (/proc/sys/vm/nr_hugepages, or hugepagesz= hugepages= on the kernel command line for 1G pages), or run without --hugepages",
            size >> 20,
            size / pages.bytes(),
            std::io::Error::last_os_error()
        )));
    }
    Ok(file)
}

/// A KVM VM with its platform devices in the kernel.
pub struct Vm {
    fd: VmFd,
    supported_cpuid: CpuId,
    max_vcpus: u32,
    /// The guest RAM registered as memory slots, held so that its mappings outlive every
    /// slot that points at them (declared after `fd`: the VM closes first).
    mem: GuestMemoryMmap,
}

impl Vm {
    /// Opens /dev/kvm and creates a VM with `mem` as its RAM and the in-kernel irqchip
    /// and PIT.
    ///
    /// The memory slots go in first, for start-up time: a slot change waits for an SRCU
    /// grace period on the VM (`kvm_swap_active_memslots`), and creating the irqchip
    /// leaves the VM's SRCU busy for several milliseconds. A slot registered right after
    /// the irqchip and PIT waited 4-17 ms here (off-CPU); registered first, 0.1 ms, and
    /// the irqchip and PIT after it take as long as before (docs/vmm.md, "Start-up").
    /// Firecracker uses the same order. The VM keeps a handle on `mem`, so its mappings
    /// live as long as the slots that point at them.
    pub fn new(mem: &GuestMemoryMmap) -> Result<Self, VstateError> {
        let kvm = Kvm::new().map_err(VstateError::KvmUnavailable)?;
        // Anything but KVM's one stable API answers differently (or not at all: ENOTTY).
        if kvm.get_api_version() != KVM_API_VERSION {
            return Err(VstateError::KvmUnavailable(kvm_ioctls::Error::new(
                libc::ENOTTY,
            )));
        }
        let supported_cpuid = kvm
            .get_supported_cpuid(KVM_MAX_CPUID_ENTRIES)
            .map_err(kvm_err("report its supported CPUID"))?;
        let max_vcpus = (kvm.get_max_vcpus() as u32).min(MAX_SUPPORTED_CPUS);
        let fd = kvm.create_vm().map_err(kvm_err("create a VM"))?;
        fd.set_tss_address(KVM_TSS_ADDRESS as usize)
            .map_err(kvm_err("set the TSS address"))?;
        fd.set_identity_map_address(KVM_IDENTITY_MAP_ADDRESS)
            .map_err(kvm_err("set the identity map address"))?;
        let vm = Self {
            fd,
            supported_cpuid,
            max_vcpus,
            mem: mem.clone(),
        };
        vm.register_memory()?;
        vm.fd
            .create_irq_chip()
            .map_err(kvm_err("create the in-kernel irqchip"))?;
        let pit = kvm_pit_config {
            flags: KVM_PIT_SPEAKER_DUMMY,
            ..Default::default()
        };
        vm.fd
            .create_pit2(pit)
            .map_err(kvm_err("create the in-kernel PIT"))?;
        Ok(vm)
    }

    /// The most vCPUs this VM can have (KVM's limit, capped by the MP table's).
    pub fn max_vcpus(&self) -> u32 {
        self.max_vcpus
    }

    /// KVM's supported CPUID, the base of every vCPU's table.
    pub fn supported_cpuid(&self) -> &CpuId {
        &self.supported_cpuid
    }

    /// Registers every region of the guest RAM as a KVM memory slot.
    fn register_memory(&self) -> Result<(), VstateError> {
        for (slot, region) in self.mem.iter().enumerate() {
            let host = region
                .get_host_address(vm_memory::MemoryRegionAddress(0))
                .map_err(|e| VstateError::Memory(format!("Guest memory region unmapped: {e}")))?;
            let region_desc = kvm_userspace_memory_region {
                slot: slot as u32,
                guest_phys_addr: region.start_addr().0,
                memory_size: region.len(),
                userspace_addr: host as u64,
                flags: 0,
            };
            // SAFETY: the host range is a live mmap of `self.mem`, which the VM holds for
            // as long as it exists, so no slot ever points at unmapped or reused memory.
            unsafe { self.fd.set_user_memory_region(region_desc) }
                .map_err(kvm_err("register guest memory"))?;
        }
        Ok(())
    }

    /// Wires `event` to interrupt line `gsi`.
    pub fn register_irqfd(&self, event: &EventFd, gsi: u32) -> Result<(), VstateError> {
        self.fd
            .register_irqfd(event, gsi)
            .map_err(kvm_err("register an irqfd"))
    }

    /// Creates vCPU `id` (its APIC id too).
    pub fn create_vcpu(&self, id: u32) -> Result<VcpuFd, VstateError> {
        self.fd
            .create_vcpu(u64::from(id))
            .map_err(kvm_err("create a vCPU"))
    }

    /// The VM file descriptor, for device code that needs more ioctls.
    pub fn fd(&self) -> &VmFd {
        &self.fd
    }
}
