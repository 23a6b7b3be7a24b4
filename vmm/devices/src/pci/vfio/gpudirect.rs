//! NVIDIA's GPUDirect clique capability (QEMU's `x-nv-gpudirect-clique`): an emulated
//! vendor-specific capability that tells NVIDIA's guest driver which passed-through GPUs
//! may do peer-to-peer DMA with each other (the GPUs sharing a clique id).
//!
//! Layout (8 bytes at config offset 0xD4, first in the standard list):
//!
//! | byte | value |
//! |---|---|
//! | 0 | 0x09, vendor-specific capability id |
//! | 1 | next pointer: the device's own list head |
//! | 2 | 8, the capability's length |
//! | 3-5 | `'P' '2' 'P'` |
//! | 6 | clique id in bits 3-6 (`clique << 3`) |
//! | 7 | 0 |
//!
//! Only an NVIDIA display-class function gets it, and only when no capability of the
//! device covers 0xD4-0xDB (QEMU falls back to 0xC8 for pre-Turing GPUs; this VMM places it
//! at 0xD4 only, the offset NVIDIA documents for Turing and later).

use super::backend::VfioBackend;
use super::capability::{id, msi_cap_len, walk_caps, EXT_CAP_START};

/// NVIDIA's PCI vendor id.
pub const NVIDIA_VENDOR_ID: u16 = 0x10de;
/// Where the capability is placed.
pub const GPUDIRECT_CAP_OFFSET: usize = 0xd4;
/// Bytes the capability covers.
pub const GPUDIRECT_CAP_LEN: usize = 8;
/// The largest clique id (4 bits).
pub const MAX_CLIQUE: u8 = 15;
/// PCI base class of display controllers (VGA 0300, 3D 0302).
const CLASS_DISPLAY: u8 = 0x03;
/// Vendor-specific capability id.
const CAP_ID_VENDOR: u8 = 0x09;
/// PCI power management capability id.
const CAP_ID_PM: u8 = 0x01;
/// PCI Express capability id.
const CAP_ID_EXP: u8 = 0x10;

/// Why the clique capability cannot be given to a device.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum GpuDirectError {
    /// The clique id does not fit in 4 bits.
    #[error("GPUDirect clique {0} is out of range; use gpudirect_clique=0 to 15")]
    CliqueRange(u8),
    /// The device is not NVIDIA's.
    #[error(
        "gpudirect_clique is for NVIDIA GPUs, but the device's vendor id is {vendor:#06x} \
         (NVIDIA is 0x10de); remove gpudirect_clique from this device"
    )]
    NotNvidia {
        /// The device's vendor id.
        vendor: u16,
    },
    /// The device is NVIDIA's but not a display controller.
    #[error(
        "gpudirect_clique is for NVIDIA GPUs, but the device's class is {class:#04x}xx, not a \
         display controller (03xx); remove gpudirect_clique from this device"
    )]
    NotDisplay {
        /// The device's base class.
        class: u8,
    },
    /// A capability of the device covers 0xD4-0xDB.
    #[error(
        "The device's capability {id:#04x} at {offset:#x} covers config offset 0xd4, where the \
         GPUDirect clique capability goes; remove gpudirect_clique from this device"
    )]
    Occupied {
        /// The capability's id.
        id: u8,
        /// Its offset.
        offset: usize,
    },
    /// The device's configuration space could not be read.
    #[error("Cannot read the device's configuration space to add the GPUDirect capability")]
    ConfigRead,
}

/// The emulated capability, as placed in one device's configuration space.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct GpuDirectCap {
    clique: u8,
    /// The device's own capability list head, which this capability points on to.
    next: u8,
}

/// Bytes a standard capability at `offset` of `cfg` covers, where its id says; otherwise
/// up to the next capability above it (or the end of the standard space): unknown
/// capabilities are taken to be as long as they could be.
fn cap_len(cfg: &[u8], offset: usize, id: u8, starts: &[usize]) -> usize {
    let until_next = starts
        .iter()
        .copied()
        .filter(|&s| s > offset)
        .min()
        .unwrap_or(EXT_CAP_START)
        - offset;
    let known = match id {
        CAP_ID_PM => 8,
        id::MSI => msi_cap_len(cfg, offset),
        CAP_ID_EXP => 0x3c,
        id::MSIX => 12,
        CAP_ID_VENDOR => usize::from(cfg.get(offset + 2).copied().unwrap_or(0)).max(3),
        _ => until_next,
    };
    known.max(2)
}

impl GpuDirectCap {
    /// The capability for clique `clique` in the configuration space `cfg` (at least its
    /// first 256 bytes, as the device shows them): refused unless the device is an NVIDIA
    /// display controller with 0xD4-0xDB free.
    pub fn place(cfg: &[u8], clique: u8) -> Result<Self, GpuDirectError> {
        if clique > MAX_CLIQUE {
            return Err(GpuDirectError::CliqueRange(clique));
        }
        if cfg.len() < EXT_CAP_START {
            return Err(GpuDirectError::ConfigRead);
        }
        let vendor = u16::from_le_bytes([cfg[0], cfg[1]]);
        if vendor != NVIDIA_VENDOR_ID {
            return Err(GpuDirectError::NotNvidia { vendor });
        }
        let class = cfg[0x0b];
        if class != CLASS_DISPLAY {
            return Err(GpuDirectError::NotDisplay { class });
        }
        let caps = walk_caps(cfg);
        let starts: Vec<usize> = caps.iter().map(|c| c.offset).collect();
        let ours = GPUDIRECT_CAP_OFFSET..GPUDIRECT_CAP_OFFSET + GPUDIRECT_CAP_LEN;
        for cap in &caps {
            let end = cap.offset + cap_len(cfg, cap.offset, cap.id, &starts);
            if cap.offset < ours.end && end > ours.start {
                return Err(GpuDirectError::Occupied {
                    id: cap.id,
                    offset: cap.offset,
                });
            }
        }
        Ok(Self {
            clique,
            // Legacy capabilities sit where one-byte pointers put them: below 256.
            next: caps
                .first()
                .and_then(|c| u8::try_from(c.offset).ok())
                .unwrap_or(0),
        })
    }

    /// Reads the first 256 bytes of `backend`'s configuration space and places the
    /// capability there ([`GpuDirectCap::place`]).
    pub fn for_device(backend: &dyn VfioBackend, clique: u8) -> Result<Self, GpuDirectError> {
        let mut cfg = vec![0u8; EXT_CAP_START];
        for (i, chunk) in cfg.chunks_mut(4).enumerate() {
            backend
                .config_read((i * 4) as u64, chunk)
                .map_err(|_| GpuDirectError::ConfigRead)?;
        }
        Self::place(&cfg, clique)
    }

    /// The clique id.
    pub fn clique(&self) -> u8 {
        self.clique
    }

    /// The capability's 8 bytes, as the guest reads them at [`GPUDIRECT_CAP_OFFSET`].
    pub fn bytes(&self) -> [u8; GPUDIRECT_CAP_LEN] {
        [
            CAP_ID_VENDOR,
            self.next,
            const { crate::narrow::const_u8(GPUDIRECT_CAP_LEN as u64) },
            b'P',
            b'2',
            b'P',
            self.clique << 3,
            0,
        ]
    }

    /// Dword `reg` of the capability, when `reg` is one of its two.
    pub fn read_reg(&self, reg: usize) -> Option<u32> {
        let rel = reg.checked_mul(4)?.checked_sub(GPUDIRECT_CAP_OFFSET)?;
        let b = self.bytes();
        let dword = b.get(rel..rel + 4)?;
        Some(u32::from_le_bytes(dword.try_into().ok()?))
    }
}

#[cfg(test)]
mod tests {
    use super::super::model::{ModelGpu, ModelReset};
    use super::*;

    fn model_cfg() -> Vec<u8> {
        let gpu = ModelGpu::new(ModelReset::Flr).unwrap();
        let mut cfg = vec![0u8; 256];
        for (i, chunk) in cfg.chunks_mut(4).enumerate() {
            gpu.config_read((i * 4) as u64, chunk).unwrap();
        }
        cfg
    }

    #[test]
    fn the_model_gpu_gets_the_capability_at_0xd4_heading_its_list() {
        let gpu = ModelGpu::new(ModelReset::Flr).unwrap();
        let cap = GpuDirectCap::for_device(&gpu, 5).unwrap();
        assert_eq!(cap.bytes(), [0x09, 0x60, 8, b'P', b'2', b'P', 5 << 3, 0]);
        assert_eq!(cap.read_reg(0xd4 / 4), Some(0x5008_6009));
        assert_eq!(cap.read_reg(0xd8 / 4), Some(0x0028_5032));
        assert_eq!(cap.read_reg(0xd0 / 4), None);
        assert_eq!(cap.read_reg(0xdc / 4), None);
        assert_eq!(
            GpuDirectCap::place(&model_cfg(), 15).unwrap().bytes()[6],
            0x78
        );
    }

    #[test]
    fn out_of_range_cliques_other_vendors_and_classes_are_refused() {
        let cfg = model_cfg();
        assert_eq!(
            GpuDirectCap::place(&cfg, 16),
            Err(GpuDirectError::CliqueRange(16))
        );
        let mut edu = cfg.clone();
        edu[0..2].copy_from_slice(&0x1234u16.to_le_bytes());
        let err = GpuDirectCap::place(&edu, 1).unwrap_err();
        assert_eq!(err, GpuDirectError::NotNvidia { vendor: 0x1234 });
        assert!(err.to_string().contains("0x1234"), "{err}");
        assert!(err.to_string().contains("remove gpudirect_clique"), "{err}");
        let mut audio = cfg.clone();
        audio[0x0b] = 0x04;
        assert_eq!(
            GpuDirectCap::place(&audio, 1),
            Err(GpuDirectError::NotDisplay { class: 0x04 })
        );
        assert_eq!(
            GpuDirectCap::place(&cfg[..64], 1),
            Err(GpuDirectError::ConfigRead)
        );
    }

    #[test]
    fn a_capability_covering_0xd4_is_not_overwritten() {
        let base = model_cfg();
        // MSI-X moved to 0xd0: its 12 bytes run to 0xdc.
        let mut cfg = base.clone();
        cfg[0x79] = 0xd0;
        cfg[0xd0..0xdc].copy_from_slice(&base[0xb4..0xc0]);
        assert_eq!(
            GpuDirectCap::place(&cfg, 1),
            Err(GpuDirectError::Occupied {
                id: 0x11,
                offset: 0xd0
            })
        );
        // A capability starting inside the range.
        let mut cfg = base.clone();
        cfg[0xb5] = 0xd8;
        cfg[0xd8] = 0x09;
        cfg[0xda] = 4;
        assert!(matches!(
            GpuDirectCap::place(&cfg, 1),
            Err(GpuDirectError::Occupied { offset: 0xd8, .. })
        ));
        // An unknown capability last before 0xd4 may run to the end of the space.
        let mut cfg = base.clone();
        cfg[0xb5] = 0xc0;
        cfg[0xc0] = 0x0d;
        assert!(matches!(
            GpuDirectCap::place(&cfg, 1),
            Err(GpuDirectError::Occupied { offset: 0xc0, .. })
        ));
        // ... but not past the next one (PM at 0xc8, 8 bytes).
        cfg[0xc1] = 0xc8;
        cfg[0xc8] = 0x01;
        cfg[0xc9] = 0x00;
        GpuDirectCap::place(&cfg, 1).unwrap();
    }

    #[test]
    fn a_device_without_capabilities_gets_a_list_of_one() {
        let mut cfg = model_cfg();
        cfg[0x06] &= !0x10;
        let cap = GpuDirectCap::place(&cfg, 0).unwrap();
        assert_eq!(cap.bytes()[1], 0);
    }
}
