//! CPUID for one vCPU: KVM's supported set, filtered, and the physical address width the
//! guest is told ([`set_cpuid_phys_bits`]).
//!
//! Each vCPU gets its own APIC id and a topology of `n` single-threaded cores in one
//! package. Features the VMM does not emulate (MONITOR/MWAIT, the PMU, thermal and power
//! management) are hidden, and the hypervisor bit is set.

use kvm_bindings::{kvm_cpuid_entry2, CpuId};

/// CPUID.1:ECX bit 3, MONITOR/MWAIT.
const LEAF1_ECX_MONITOR: u32 = 1 << 3;
/// CPUID.1:ECX bit 31, running under a hypervisor.
const LEAF1_ECX_HYPERVISOR: u32 = 1 << 31;
/// CPUID.1:EDX bit 28, more than one logical processor per package.
const LEAF1_EDX_HTT: u32 = 1 << 28;
/// CLFLUSH line size in 8-byte units (64 bytes).
const CLFLUSH_LINE_SIZE: u32 = 8;
/// Extended topology level types.
const LEVEL_TYPE_SMT: u32 = 1;
const LEVEL_TYPE_CORE: u32 = 2;
/// CPUID.80000001:ECX bit 1, core multi-processing legacy mode (AMD).
const EXT_ECX_CMP_LEGACY: u32 = 1 << 1;

/// Returns the CPUID table for vCPU `cpu_id` of `cpu_count`, from KVM's `supported` set.
pub fn filter(supported: &CpuId, cpu_id: u32, cpu_count: u32) -> CpuId {
    let mut cpuid = supported.clone();
    let amd = is_amd(supported.as_slice());
    // Bits needed to number `cpu_count` cores.
    let core_bits = 32 - cpu_count.saturating_sub(1).leading_zeros();
    for entry in cpuid.as_mut_slice() {
        filter_entry(entry, cpu_id, cpu_count, core_bits, amd);
    }
    cpuid
}

fn is_amd(entries: &[kvm_cpuid_entry2]) -> bool {
    entries
        .iter()
        .find(|e| e.function == 0)
        .is_some_and(|e| e.ebx == u32::from_le_bytes(*b"Auth"))
}

fn filter_entry(e: &mut kvm_cpuid_entry2, cpu_id: u32, cpu_count: u32, core_bits: u32, amd: bool) {
    match e.function {
        0x1 => {
            e.ebx = (cpu_id << 24) | ((cpu_count & 0xff) << 16) | (CLFLUSH_LINE_SIZE << 8);
            e.ecx = (e.ecx & !LEAF1_ECX_MONITOR) | LEAF1_ECX_HYPERVISOR;
            if cpu_count > 1 {
                e.edx |= LEAF1_EDX_HTT;
            } else {
                e.edx &= !LEAF1_EDX_HTT;
            }
        }
        // Deterministic cache parameters: cores per package - 1 in EAX[31:26], logical
        // processors sharing the cache (one: no SMT) in EAX[25:14].
        0x4 if e.eax & 0x1f != 0 => {
            e.eax = (e.eax & 0x3fff) | ((cpu_count.saturating_sub(1) & 0x3f) << 26);
        }
        // Thermal/power management and the architectural PMU are not emulated.
        0x6 | 0xa => {
            e.eax = 0;
            e.ebx = 0;
            e.ecx = 0;
            e.edx = 0;
        }
        0xb | 0x1f => {
            e.edx = cpu_id;
            match e.index {
                0 => {
                    e.eax = 0;
                    e.ebx = 1;
                    e.ecx = (LEVEL_TYPE_SMT << 8) | e.index;
                }
                1 => {
                    e.eax = core_bits;
                    e.ebx = cpu_count;
                    e.ecx = (LEVEL_TYPE_CORE << 8) | e.index;
                }
                _ => {
                    e.eax = 0;
                    e.ebx = 0;
                    e.ecx = e.index;
                }
            }
        }
        0x8000_0001 if amd => {
            if cpu_count > 1 {
                e.ecx |= EXT_ECX_CMP_LEGACY;
            } else {
                e.ecx &= !EXT_ECX_CMP_LEGACY;
            }
        }
        0x8000_0008 if amd => {
            // NC (cores - 1) in ECX[7:0], APIC id size in ECX[15:12].
            e.ecx = (e.ecx & !0xf0ff) | (core_bits << 12) | (cpu_count.saturating_sub(1) & 0xff);
        }
        _ => {}
    }
}

/// Advertises `phys_bits` physical address bits in CPUID leaf 0x8000_0008 (`EAX[7:0]`), so
/// the guest's view matches the PCI windows.
pub fn set_cpuid_phys_bits(cpuid: &mut CpuId, phys_bits: u8) {
    for e in cpuid.as_mut_slice() {
        if e.function == 0x8000_0008 {
            e.eax = (e.eax & !0xff) | u32::from(phys_bits);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn entry(function: u32, index: u32) -> kvm_cpuid_entry2 {
        kvm_cpuid_entry2 {
            function,
            index,
            ecx: LEAF1_ECX_MONITOR,
            ..Default::default()
        }
    }

    fn find(c: &CpuId, function: u32, index: u32) -> kvm_cpuid_entry2 {
        *c.as_slice()
            .iter()
            .find(|e| e.function == function && e.index == index)
            .unwrap()
    }

    #[test]
    fn each_vcpu_gets_its_apic_id_and_topology() {
        let supported =
            CpuId::from_entries(&[entry(0, 0), entry(1, 0), entry(0xb, 0), entry(0xb, 1)]).unwrap();
        let c = filter(&supported, 3, 4);
        let leaf1 = find(&c, 1, 0);
        assert_eq!(leaf1.ebx >> 24, 3);
        assert_eq!((leaf1.ebx >> 16) & 0xff, 4);
        assert_eq!(leaf1.ecx & LEAF1_ECX_MONITOR, 0);
        assert_ne!(leaf1.ecx & LEAF1_ECX_HYPERVISOR, 0);
        assert_ne!(leaf1.edx & LEAF1_EDX_HTT, 0);
        let core = find(&c, 0xb, 1);
        assert_eq!((core.eax, core.ebx, core.edx), (2, 4, 3));
        assert_eq!(find(&c, 0xb, 0).edx, 3);
    }

    #[test]
    fn pmu_leaf_is_hidden() {
        let mut pmu = entry(0xa, 0);
        pmu.eax = 0x0708_0304;
        let c = filter(&CpuId::from_entries(&[pmu]).unwrap(), 0, 1);
        assert_eq!(find(&c, 0xa, 0).eax, 0);
    }

    #[test]
    fn cpuid_advertises_the_given_phys_bits() {
        let mut cpuid = CpuId::new(1).unwrap();
        cpuid.as_mut_slice()[0].function = 0x8000_0008;
        cpuid.as_mut_slice()[0].eax = 0x3030;
        set_cpuid_phys_bits(&mut cpuid, 46);
        assert_eq!(cpuid.as_slice()[0].eax, 0x302e);
    }
}
