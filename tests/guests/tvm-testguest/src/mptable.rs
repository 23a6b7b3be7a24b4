//! The Intel MultiProcessor Specification 1.4 tables: the floating pointer and the
//! configuration table's processor and I/O APIC entries. Every length and checksum is
//! checked: the table comes from the VMM under test.

/// Most processors the guest tracks.
pub const MAX_CPUS: usize = 64;

const MPF_SIGNATURE: &[u8; 4] = b"_MP_";
const MPC_SIGNATURE: &[u8; 4] = b"PCMP";
const MPC_HEADER_SIZE: usize = 44;

/// Why the MP table could not be used.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MpTableError {
    /// No valid floating pointer structure in the BIOS areas searched.
    NoFloatingPointer,
    /// The floating pointer asks for a default configuration (no table).
    DefaultConfiguration(u8),
    /// The configuration table's signature is not "PCMP".
    BadSignature,
    /// The configuration table's length is shorter than its header or its entries.
    BadLength(usize),
    /// The configuration table's checksum is wrong.
    BadChecksum,
    /// An entry has an unknown type, so the rest cannot be walked.
    UnknownEntry(u8),
    /// More enabled processors than the guest tracks.
    TooManyCpus,
    /// No processor entry is marked enabled.
    NoCpus,
}

impl core::fmt::Display for MpTableError {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        match self {
            Self::NoFloatingPointer => write!(
                f,
                "No MP floating pointer in the EBDA, 0x9fc00 or 0xf0000-0xfffff"
            ),
            Self::DefaultConfiguration(t) => write!(
                f,
                "MP floating pointer names default configuration {t}; provide a table"
            ),
            Self::BadSignature => write!(f, "MP configuration table signature is not PCMP"),
            Self::BadLength(l) => write!(
                f,
                "MP configuration table length {l} is inconsistent with its entries"
            ),
            Self::BadChecksum => write!(f, "MP configuration table checksum is wrong"),
            Self::UnknownEntry(t) => {
                write!(f, "MP configuration table has an entry of unknown type {t}")
            }
            Self::TooManyCpus => write!(f, "MP table lists more than {MAX_CPUS} processors"),
            Self::NoCpus => write!(f, "MP table lists no enabled processor"),
        }
    }
}

/// One enabled processor from the table.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Cpu {
    /// Local APIC id.
    pub apic_id: u8,
    /// Marked as the bootstrap processor.
    pub bsp: bool,
}

/// What the guest needs from the configuration table.
#[derive(Clone, Copy, Debug)]
pub struct MpConfig {
    /// Physical address of the local APIC.
    pub lapic_address: u32,
    cpus: [Cpu; MAX_CPUS],
    cpu_count: usize,
    /// Number of I/O APIC entries.
    pub ioapics: usize,
}

impl MpConfig {
    /// The enabled processors, in table order.
    pub fn cpus(&self) -> &[Cpu] {
        &self.cpus[..self.cpu_count]
    }
}

fn checksum_ok(bytes: &[u8]) -> bool {
    bytes.iter().fold(0u8, |a, b| a.wrapping_add(*b)) == 0
}

/// Finds a valid floating pointer in `area` (16-byte aligned) and returns the
/// configuration table's physical address.
pub fn find_floating_pointer(area: &[u8]) -> Result<Option<u32>, MpTableError> {
    let mut off = 0;
    while off + 16 <= area.len() {
        let candidate = &area[off..off + 16];
        if &candidate[..4] == MPF_SIGNATURE && candidate[8] == 1 && checksum_ok(candidate) {
            if candidate[11] != 0 {
                return Err(MpTableError::DefaultConfiguration(candidate[11]));
            }
            let ptr = u32::from_le_bytes([candidate[4], candidate[5], candidate[6], candidate[7]]);
            return Ok(Some(ptr));
        }
        off += 16;
    }
    Ok(None)
}

/// The base table length from a configuration table header (to know how much to read).
pub fn config_length(header: &[u8; MPC_HEADER_SIZE]) -> Result<usize, MpTableError> {
    if &header[..4] != MPC_SIGNATURE {
        return Err(MpTableError::BadSignature);
    }
    let len = usize::from(u16::from_le_bytes([header[4], header[5]]));
    if len < MPC_HEADER_SIZE {
        return Err(MpTableError::BadLength(len));
    }
    Ok(len)
}

/// Parses a whole configuration table (`config_length` bytes).
pub fn parse_config(table: &[u8]) -> Result<MpConfig, MpTableError> {
    let mut header = [0u8; MPC_HEADER_SIZE];
    header.copy_from_slice(
        table
            .get(..MPC_HEADER_SIZE)
            .ok_or(MpTableError::BadLength(table.len()))?,
    );
    let len = config_length(&header)?;
    let table = table.get(..len).ok_or(MpTableError::BadLength(len))?;
    if !checksum_ok(table) {
        return Err(MpTableError::BadChecksum);
    }
    let entries = u16::from_le_bytes([table[34], table[35]]);
    let lapic_address = u32::from_le_bytes([table[36], table[37], table[38], table[39]]);
    let mut cfg = MpConfig {
        lapic_address,
        cpus: [Cpu::default(); MAX_CPUS],
        cpu_count: 0,
        ioapics: 0,
    };
    let mut off = MPC_HEADER_SIZE;
    for _ in 0..entries {
        let kind = *table.get(off).ok_or(MpTableError::BadLength(len))?;
        let size = match kind {
            0 => 20,
            1..=4 => 8,
            other => return Err(MpTableError::UnknownEntry(other)),
        };
        let entry = table
            .get(off..off + size)
            .ok_or(MpTableError::BadLength(len))?;
        match kind {
            0 if entry[3] & 1 != 0 => {
                if cfg.cpu_count == MAX_CPUS {
                    return Err(MpTableError::TooManyCpus);
                }
                cfg.cpus[cfg.cpu_count] = Cpu {
                    apic_id: entry[1],
                    bsp: entry[3] & 2 != 0,
                };
                cfg.cpu_count += 1;
            }
            2 if entry[3] & 1 != 0 => cfg.ioapics += 1,
            _ => {}
        }
        off += size;
    }
    if cfg.cpu_count == 0 {
        return Err(MpTableError::NoCpus);
    }
    Ok(cfg)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::vec::Vec;

    fn fix_checksum(bytes: &mut [u8], at: usize) {
        bytes[at] = 0;
        let sum = bytes.iter().fold(0u8, |a, b| a.wrapping_add(*b));
        bytes[at] = 0u8.wrapping_sub(sum);
    }

    fn table(cpus: &[(u8, u8)], ioapics: usize) -> Vec<u8> {
        let mut t = Vec::new();
        t.extend_from_slice(b"PCMP");
        t.extend_from_slice(&[0, 0, 4, 0]);
        t.extend_from_slice(b"TENANTVMTESTGUEST   ");
        t.extend_from_slice(&[0; 6]);
        let count = (cpus.len() + ioapics) as u16;
        t.extend_from_slice(&count.to_le_bytes());
        t.extend_from_slice(&0xfee0_0000u32.to_le_bytes());
        t.extend_from_slice(&[0; 4]);
        assert_eq!(t.len(), MPC_HEADER_SIZE);
        for (id, flags) in cpus {
            let mut e = [0u8; 20];
            e[1] = *id;
            e[3] = *flags;
            t.extend_from_slice(&e);
        }
        for i in 0..ioapics {
            t.extend_from_slice(&[2, i as u8, 0x11, 1, 0, 0, 0xc0, 0xfe]);
        }
        let len = t.len() as u16;
        t[4..6].copy_from_slice(&len.to_le_bytes());
        fix_checksum(&mut t, 7);
        t
    }

    #[test]
    fn parses_enabled_processors_and_ioapic() {
        let cfg = parse_config(&table(&[(0, 3), (1, 1), (2, 0), (3, 1)], 1)).unwrap();
        let ids: Vec<u8> = cfg.cpus().iter().map(|c| c.apic_id).collect();
        assert_eq!(ids, [0, 1, 3]);
        assert!(cfg.cpus()[0].bsp);
        assert_eq!(cfg.ioapics, 1);
        assert_eq!(cfg.lapic_address, 0xfee0_0000);
    }

    #[test]
    fn bad_checksum_is_refused() {
        let mut t = table(&[(0, 3)], 0);
        t[20] ^= 0xff;
        assert_eq!(parse_config(&t).err(), Some(MpTableError::BadChecksum));
    }

    #[test]
    fn entry_count_past_the_length_is_refused() {
        let mut t = table(&[(0, 3)], 0);
        t[34] = 5;
        fix_checksum(&mut t, 7);
        assert!(matches!(parse_config(&t), Err(MpTableError::BadLength(_))));
    }

    #[test]
    fn unknown_entry_type_is_refused() {
        let mut t = table(&[(0, 3)], 0);
        t[MPC_HEADER_SIZE] = 9;
        fix_checksum(&mut t, 7);
        assert_eq!(parse_config(&t).err(), Some(MpTableError::UnknownEntry(9)));
    }

    #[test]
    fn table_without_enabled_cpus_is_refused() {
        assert_eq!(
            parse_config(&table(&[(0, 0)], 1)).err(),
            Some(MpTableError::NoCpus)
        );
    }

    #[test]
    fn floating_pointer_is_found_on_a_16_byte_boundary() {
        let mut area = std::vec![0u8; 64];
        area[32..36].copy_from_slice(b"_MP_");
        area[36..40].copy_from_slice(&0x000f_0100u32.to_le_bytes());
        area[40] = 1;
        area[41] = 4;
        let mut fp = [0u8; 16];
        fp.copy_from_slice(&area[32..48]);
        fix_checksum(&mut fp, 10);
        area[32..48].copy_from_slice(&fp);
        assert_eq!(find_floating_pointer(&area), Ok(Some(0x000f_0100)));
        area[33] = b'x';
        assert_eq!(find_floating_pointer(&area), Ok(None));
    }
}
