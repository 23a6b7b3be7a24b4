//! Walks the capability lists of a configuration space read from a device: the standard
//! list (from the pointer at 0x34, within the first 256 bytes) and the PCIe extended list
//! (from 0x100). A broken or hostile device may point a list at itself, backwards, or out
//! of range: every walk visits an offset at most once and stops at a fixed count.

/// Offset of the capabilities pointer.
const CAP_POINTER: usize = 0x34;
/// Status register byte holding the capability-list bit.
const STATUS_HIGH_BYTE: usize = 0x06;
/// Status: capability list present.
const STATUS_CAP_LIST: u8 = 1 << 4;
/// First offset of the extended capabilities.
pub const EXT_CAP_START: usize = 0x100;
/// Size of PCIe configuration space.
pub const PCIE_CONFIG_SIZE: usize = 0x1000;
/// Most standard capabilities the 192 bytes after the header can hold.
const MAX_CAPS: usize = 48;
/// Most extended capabilities the 3840 bytes after 0x100 can hold.
const MAX_EXT_CAPS: usize = 960;

/// Standard capability IDs this VMM looks at.
pub mod id {
    /// Message Signalled Interrupts.
    pub const MSI: u8 = 0x05;
    /// MSI-X.
    pub const MSIX: u8 = 0x11;
}

/// Extended capability IDs this VMM hides from the guest.
pub mod ext_id {
    /// Alternative Routing-ID Interpretation.
    pub const ARI: u16 = 0x000e;
    /// Single Root I/O Virtualization.
    pub const SRIOV: u16 = 0x0010;
    /// Resizable BAR.
    pub const REBAR: u16 = 0x0015;
}

/// A standard capability: its ID and offset.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PciCap {
    /// Capability ID.
    pub id: u8,
    /// Offset in configuration space.
    pub offset: usize,
}

/// An extended capability: its header fields and offset.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ExtCap {
    /// Capability ID.
    pub id: u16,
    /// Capability version.
    pub version: u8,
    /// Offset in configuration space.
    pub offset: usize,
    /// Offset of the next capability (0: last).
    pub next: usize,
}

fn dword(cfg: &[u8], at: usize) -> Option<u32> {
    Some(u32::from_le_bytes(cfg.get(at..at + 4)?.try_into().ok()?))
}

/// The standard capabilities of `cfg` (at least the first 256 bytes of a configuration
/// space), in list order. Stops at the first pointer that is out of range or seen before.
pub fn walk_caps(cfg: &[u8]) -> Vec<PciCap> {
    let mut caps = Vec::new();
    if cfg.len() < EXT_CAP_START || cfg[STATUS_HIGH_BYTE] & STATUS_CAP_LIST == 0 {
        return caps;
    }
    let mut seen = [false; EXT_CAP_START];
    let mut ptr = usize::from(cfg[CAP_POINTER] & 0xfc);
    while (0x40..EXT_CAP_START - 1).contains(&ptr) && !seen[ptr] && caps.len() < MAX_CAPS {
        seen[ptr] = true;
        caps.push(PciCap {
            id: cfg[ptr],
            offset: ptr,
        });
        ptr = usize::from(cfg[ptr + 1] & 0xfc);
    }
    caps
}

/// The extended capabilities of `cfg` (a 4 KiB configuration space; shorter spaces have
/// none), in list order. Stops at an empty header, an out-of-range or already-seen
/// pointer.
pub fn walk_ext_caps(cfg: &[u8]) -> Vec<ExtCap> {
    let mut caps = Vec::new();
    if cfg.len() < PCIE_CONFIG_SIZE {
        return caps;
    }
    let mut seen = vec![false; PCIE_CONFIG_SIZE / 4];
    let mut offset = EXT_CAP_START;
    while caps.len() < MAX_EXT_CAPS {
        let Some(header) = dword(cfg, offset) else {
            break;
        };
        if header == 0 || header == u32::MAX || seen[offset / 4] {
            break;
        }
        seen[offset / 4] = true;
        let next = (header >> 20) as usize & 0xffc;
        caps.push(ExtCap {
            // The header's low half is the capability ID.
            id: crate::narrow::low_u16(header.into()),
            version: ((header >> 16) & 0xf) as u8,
            offset,
            next,
        });
        if next < EXT_CAP_START {
            break;
        }
        offset = next;
    }
    caps
}

/// Bytes an MSI capability at `offset` covers: 10, plus 4 for 64-bit addresses, plus 10
/// for per-vector masking.
pub(super) fn msi_cap_len(cfg: &[u8], offset: usize) -> usize {
    let control = cfg.get(offset + 2).copied().unwrap_or(0);
    let pvm = cfg.get(offset + 3).copied().unwrap_or(0) & 1 != 0;
    10 + if control & 0x80 != 0 { 4 } else { 0 } + if pvm { 10 } else { 0 }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn space() -> Vec<u8> {
        let mut cfg = vec![0u8; PCIE_CONFIG_SIZE];
        cfg[STATUS_HIGH_BYTE] = STATUS_CAP_LIST;
        cfg[CAP_POINTER] = 0x40;
        cfg[0x40] = id::MSI;
        cfg[0x41] = 0x50;
        cfg[0x50] = id::MSIX;
        cfg[0x51] = 0;
        cfg
    }

    fn ext(cfg: &mut [u8], at: usize, id: u16, next: usize) {
        let header = u32::from(id) | (1 << 16) | (u32::try_from(next).unwrap() << 20);
        cfg[at..at + 4].copy_from_slice(&header.to_le_bytes());
    }

    #[test]
    fn standard_list_is_walked_in_order() {
        let caps = walk_caps(&space());
        assert_eq!(
            caps,
            vec![
                PciCap {
                    id: id::MSI,
                    offset: 0x40
                },
                PciCap {
                    id: id::MSIX,
                    offset: 0x50
                }
            ]
        );
    }

    #[test]
    fn standard_list_loop_is_cut() {
        let mut cfg = space();
        cfg[0x51] = 0x40;
        assert_eq!(walk_caps(&cfg).len(), 2);
        cfg[0x41] = 0x40;
        assert_eq!(walk_caps(&cfg).len(), 1);
        // No capability-list bit: nothing, whatever the pointer says.
        cfg[STATUS_HIGH_BYTE] = 0;
        assert!(walk_caps(&cfg).is_empty());
    }

    #[test]
    fn extended_list_is_walked_and_loops_are_cut() {
        let mut cfg = space();
        ext(&mut cfg, 0x100, ext_id::ARI, 0x140);
        ext(&mut cfg, 0x140, ext_id::SRIOV, 0x100);
        let caps = walk_ext_caps(&cfg);
        assert_eq!(caps.iter().map(|c| c.id).collect::<Vec<_>>(), [0xe, 0x10]);
        assert_eq!(caps[1].next, 0x100);
        // A conventional (256-byte) space has no extended list.
        assert!(walk_ext_caps(&cfg[..256]).is_empty());
    }

    #[test]
    fn msi_cap_length_follows_its_control_word() {
        let mut cfg = vec![0u8; 256];
        cfg[0xf4 + 2] = 0x00; // 32-bit, no per-vector mask: 10 bytes, fits before 0x100
        assert_eq!(msi_cap_len(&cfg, 0xf4), 10);
        cfg[0xf4 + 2] = 0x80;
        cfg[0xf4 + 3] = 0x01;
        assert_eq!(msi_cap_len(&cfg, 0xf4), 24);
        assert_eq!(msi_cap_len(&cfg, 0x1000), 10);
    }
}
