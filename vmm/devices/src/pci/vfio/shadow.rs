//! The configuration space a passed-through function shows the guest: the device's own
//! registers, except what the guest may not touch.
//!
//! - BAR and ROM registers never reach the device: the BARs live in a local
//!   [`PciConfiguration`] (sizes probed from the device at attach, addresses from the
//!   VMM's placement), the ROM BAR reads 0 (no option ROM is exposed).
//! - The multi-function bit of the header type is masked (one function per device).
//! - The ARI, SR-IOV and Resizable BAR extended capabilities are hidden (rewritten to the
//!   null capability with their body reading 0, writes dropped): a guest must not resize
//!   BAR1 or create virtual functions of a physical function.
//! - MSI and MSI-X capability writes never reach the device: they come back as an
//!   [`IrqChange`] for the VMM to carry out with VFIO_DEVICE_SET_IRQS (the kernel then
//!   programs the device's real capability).

use super::backend::{region_index, IrqIndex, VfioBackend};
use super::capability::{ext_id, id, msi_cap_len, walk_caps, walk_ext_caps, PCIE_CONFIG_SIZE};
use super::gpudirect::{GpuDirectCap, GPUDIRECT_CAP_LEN, GPUDIRECT_CAP_OFFSET};
use crate::pci::{BarKind, BarMove, MsiMessage, PciConfigError, PciConfiguration, PciHeader};

/// Register index of BAR 0.
const BAR0_REG: usize = 4;
/// Register index of the expansion ROM BAR.
const ROM_REG: usize = 12;
/// Register index of the header type.
const HEADER_REG: usize = 3;
/// Header type dword: everything but the multi-function bit.
const HEADER_MF_MASK: u32 = 0xff7f_ffff;
/// Register index of the command/status dword.
const COMMAND_REG: usize = 1;
/// Status register: capability list present (bit 4 of status, bit 20 of the dword).
const STATUS_CAP_LIST: u32 = 1 << 20;
/// Register index of the capabilities pointer.
const CAP_POINTER_REG: usize = 0x34 / 4;

/// Why a device could not be described to the guest.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum ShadowError {
    /// The device's configuration space could not be read.
    #[error("Cannot read the device's configuration space at {0:#x}")]
    ConfigRead(u64),
    /// A 64-bit BAR claims the last BAR slot, or a BAR size is not a power of two.
    #[error("BAR {index} of the device is malformed: {reason}")]
    BadBar {
        /// BAR index.
        index: usize,
        /// What is wrong.
        reason: &'static str,
    },
    /// The probed BAR size and the VFIO region size disagree.
    #[error("BAR {index} probes to {probed:#x} bytes but VFIO reports {region:#x}")]
    BarRegionMismatch {
        /// BAR index.
        index: usize,
        /// Size from probing.
        probed: u64,
        /// Size from VFIO.
        region: u64,
    },
    /// The MSI-X table or PBA is not inside a memory BAR of the device.
    #[error("The device's MSI-X table or PBA lies outside its BARs")]
    MsixLayout,
    /// The VMM's placement does not fit the probed BARs.
    #[error("BAR placement refused: {0}")]
    Placement(#[from] PciConfigError),
}

/// A BAR as probed on the device.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ProbedBar {
    /// BAR index (0-5).
    pub index: usize,
    /// Memory kind.
    pub kind: BarKind,
    /// Size in bytes.
    pub size: u64,
}

/// Where the device's MSI-X capability puts its table and PBA.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MsixLayout {
    /// Offset of the capability.
    pub cap: usize,
    /// Vectors (the smaller of the capability's and VFIO's count).
    pub vectors: u16,
    /// BAR holding the table.
    pub table_bar: usize,
    /// Offset of the table in that BAR.
    pub table_offset: u64,
    /// BAR holding the PBA.
    pub pba_bar: usize,
    /// Offset of the PBA in that BAR.
    pub pba_offset: u64,
}

impl MsixLayout {
    /// Size of the table in bytes.
    pub fn table_size(&self) -> u64 {
        u64::from(self.vectors) * 16
    }
    /// Size of the PBA in bytes.
    pub fn pba_size(&self) -> u64 {
        u64::from(self.vectors).div_ceil(64) * 8
    }
}

/// A hidden extended capability: its range and where the chain continues.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct HiddenCap {
    /// Offset of the capability.
    pub offset: usize,
    /// Bytes it covers.
    pub len: usize,
    /// The next capability's offset (kept so the chain stays walkable).
    pub next: usize,
}

/// What probing the device found.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DeviceProbe {
    /// Memory BARs, by index (I/O BARs are not passed through).
    pub bars: Vec<ProbedBar>,
    /// MSI-X, when the device has it and VFIO offers MSI-X interrupts.
    pub msix: Option<MsixLayout>,
    /// Offset of the MSI capability, when present and offered.
    pub msi: Option<usize>,
    /// Extended capabilities hidden from the guest.
    pub hidden: Vec<HiddenCap>,
    /// NVIDIA's GPUDirect clique capability, emulated at 0xD4 at the head of the standard
    /// list (off unless configured: [`GpuDirectCap::for_device`]).
    pub gpudirect: Option<GpuDirectCap>,
}

fn read32(backend: &dyn VfioBackend, offset: u64) -> Result<u32, ShadowError> {
    let mut b = [0u8; 4];
    backend
        .config_read(offset, &mut b)
        .map_err(|_| ShadowError::ConfigRead(offset))?;
    Ok(u32::from_le_bytes(b))
}

fn write32(backend: &dyn VfioBackend, offset: u64, value: u32) -> Result<(), ShadowError> {
    backend
        .config_write(offset, &value.to_le_bytes())
        .map_err(|_| ShadowError::ConfigRead(offset))
}

/// Writes all-ones to BAR register `reg`, reads the mask back, restores the register.
fn probe_reg(backend: &dyn VfioBackend, reg: usize) -> Result<(u32, u32), ShadowError> {
    let at = (reg * 4) as u64;
    let original = read32(backend, at)?;
    write32(backend, at, u32::MAX)?;
    let mask = read32(backend, at)?;
    write32(backend, at, original)?;
    Ok((original, mask))
}

fn probe_bars(backend: &dyn VfioBackend) -> Result<Vec<ProbedBar>, ShadowError> {
    let mut bars = Vec::new();
    let mut index = 0;
    while index < 6 {
        let (original, mask) = probe_reg(backend, BAR0_REG + index)?;
        if original & 1 == 1 {
            // I/O BAR: not passed through (no GPU needs one); the guest sees it empty.
            index += 1;
            continue;
        }
        let is64 = (original >> 1) & 3 == 2;
        let prefetchable = original & 0x8 != 0;
        let (kind, full_mask) = if is64 {
            if index == 5 {
                return Err(ShadowError::BadBar {
                    index,
                    reason: "a 64-bit BAR in the last slot",
                });
            }
            let (_, high) = probe_reg(backend, BAR0_REG + index + 1)?;
            (
                BarKind::Memory64 { prefetchable },
                (u64::from(high) << 32) | u64::from(mask & !0xf),
            )
        } else {
            (
                BarKind::Memory32 { prefetchable },
                0xffff_ffff_0000_0000 | u64::from(mask & !0xf),
            )
        };
        let step = if is64 { 2 } else { 1 };
        if mask & !0xf == 0 && (!is64 || full_mask == 0) {
            index += step;
            continue;
        }
        let size = (!full_mask).wrapping_add(1);
        if !size.is_power_of_two() || size < 16 {
            return Err(ShadowError::BadBar {
                index,
                reason: "size is not a power of two of at least 16 bytes",
            });
        }
        let region = u32::try_from(index)
            .ok()
            .and_then(|index| backend.region_info(index))
            .map_or(0, |r| r.size);
        if region != size {
            return Err(ShadowError::BarRegionMismatch {
                index,
                probed: size,
                region,
            });
        }
        bars.push(ProbedBar { index, kind, size });
        index += step;
    }
    Ok(bars)
}

fn hidden_len(id: u16, cfg: &[u8], offset: usize) -> Option<usize> {
    let len = match id {
        ext_id::ARI => 8,
        ext_id::SRIOV => 0x40,
        ext_id::REBAR => {
            let control = cfg.get(offset + 8).copied().unwrap_or(0);
            4 + 8 * usize::from((control >> 5) & 7).clamp(1, 6)
        }
        _ => return None,
    };
    Some(len.min(PCIE_CONFIG_SIZE - offset))
}

/// Probes `backend`: reads its configuration space, sizes its BARs (writing all-ones to
/// each BAR register of the device and restoring it, the only BAR writes it ever gets),
/// and finds its MSI/MSI-X capabilities and the extended capabilities to hide.
pub fn probe(backend: &dyn VfioBackend) -> Result<DeviceProbe, ShadowError> {
    let size = backend
        .region_info(region_index::CONFIG)
        .map_or(256, |r| r.size)
        .clamp(256, PCIE_CONFIG_SIZE as u64);
    // Clamped to 4 KiB above.
    let size = usize::try_from(size).unwrap_or(PCIE_CONFIG_SIZE);
    let mut cfg = vec![0u8; size];
    for (i, chunk) in cfg.chunks_mut(4).enumerate() {
        chunk.copy_from_slice(&read32(backend, (i * 4) as u64)?.to_le_bytes());
    }
    let bars = probe_bars(backend)?;
    let caps = walk_caps(&cfg);
    let offered = |index| backend.irq_info(index).map_or(0, |i| i.count);
    let cap_dword = |at: usize| u32::from_le_bytes(cfg[at..at + 4].try_into().unwrap_or([0; 4]));
    let msix = match caps.iter().find(|c| c.id == id::MSIX) {
        Some(cap) if offered(IrqIndex::Msix) > 0 && cap.offset + 12 <= 256 => {
            let control = (cap_dword(cap.offset) >> 16) as u16;
            let table = cap_dword(cap.offset + 4);
            let pba = cap_dword(cap.offset + 8);
            let layout = MsixLayout {
                cap: cap.offset,
                vectors: ((control & 0x7ff) + 1).min(offered(IrqIndex::Msix).min(2048) as u16),
                table_bar: (table & 7) as usize,
                table_offset: u64::from(table & !7),
                pba_bar: (pba & 7) as usize,
                pba_offset: u64::from(pba & !7),
            };
            let inside = |bar: usize, offset: u64, len: u64| {
                bars.iter().any(|b| {
                    b.index == bar && offset.checked_add(len).is_some_and(|end| end <= b.size)
                })
            };
            if !inside(layout.table_bar, layout.table_offset, layout.table_size())
                || !inside(layout.pba_bar, layout.pba_offset, layout.pba_size())
            {
                return Err(ShadowError::MsixLayout);
            }
            Some(layout)
        }
        _ => None,
    };
    let msi = caps
        .iter()
        .find(|c| c.id == id::MSI && c.offset + msi_cap_len(&cfg, c.offset) <= 256)
        .filter(|_| offered(IrqIndex::Msi) > 0)
        .map(|c| c.offset);
    let hidden = walk_ext_caps(&cfg)
        .into_iter()
        .filter_map(|c| {
            Some(HiddenCap {
                offset: c.offset,
                len: hidden_len(c.id, &cfg, c.offset)?,
                next: c.next,
            })
        })
        .collect();
    Ok(DeviceProbe {
        bars,
        msix,
        msi,
        hidden,
        gpudirect: None,
    })
}

/// A change of interrupt configuration the guest asked for; the VMM carries it out.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum IrqChange {
    /// The MSI-X message control word changed (enable and function-mask bits).
    Msix {
        /// The new message control.
        control: u16,
    },
    /// The MSI capability changed.
    Msi {
        /// MSI enabled.
        enabled: bool,
        /// The message the single vector sends.
        message: MsiMessage,
        /// The vector is masked (per-vector masking).
        masked: bool,
    },
}

/// What a guest configuration write caused.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct ShadowWrite {
    /// BARs it moved.
    pub moves: Vec<BarMove>,
    /// The interrupt change it asked for.
    pub irq: Option<IrqChange>,
}

/// The emulated MSI capability (one vector; multiple-message enable stays 0).
#[derive(Debug, Clone)]
struct MsiCap {
    offset: usize,
    /// Bytes the capability covers, rounded up to whole dwords.
    len: usize,
    bytes: [u8; 24],
    writable: [u8; 24],
}

impl MsiCap {
    fn new(offset: usize, device: [u8; 24]) -> Self {
        let mut bytes = device;
        let control = u16::from_le_bytes([bytes[2], bytes[3]]);
        let is64 = control & 0x80 != 0;
        let pvm = control & 0x100 != 0;
        // Disabled, one vector enabled, every payload register cleared.
        bytes[2] &= !0x71;
        let len = 10 + if is64 { 4 } else { 0 } + if pvm { 10 } else { 0 };
        bytes[4..].fill(0);
        let mut writable = [0u8; 24];
        writable[2] = 0x01; // enable
        writable[4..8].copy_from_slice(&0xffff_fffcu32.to_le_bytes());
        let data_at = if is64 {
            writable[8..12].fill(0xff);
            12
        } else {
            8
        };
        writable[data_at..data_at + 2].fill(0xff);
        if pvm {
            writable[data_at + 4] = 0x01;
        }
        writable[len..].fill(0);
        Self {
            offset,
            len: len.next_multiple_of(4),
            bytes,
            writable,
        }
    }

    fn is64(&self) -> bool {
        self.bytes[2] & 0x80 != 0
    }

    fn state(&self) -> IrqChange {
        let b = &self.bytes;
        let lo = u64::from(u32::from_le_bytes([b[4], b[5], b[6], b[7]]));
        let (address, data_at) = if self.is64() {
            let hi = u64::from(u32::from_le_bytes([b[8], b[9], b[10], b[11]]));
            (lo | (hi << 32), 12)
        } else {
            (lo, 8)
        };
        let pvm = b[3] & 0x01 != 0;
        IrqChange::Msi {
            enabled: b[2] & 0x01 != 0,
            message: MsiMessage {
                address,
                data: u32::from(u16::from_le_bytes([b[data_at], b[data_at + 1]])),
            },
            masked: pvm && b[data_at + 4] & 1 != 0,
        }
    }
}

/// The guest's view of a passed-through function's configuration space.
#[derive(Debug, Clone)]
pub struct ConfigShadow {
    bars: PciConfiguration,
    probe: DeviceProbe,
    msix_control: u16,
    msi: Option<MsiCap>,
}

impl ConfigShadow {
    /// The shadow of a probed device whose BARs the VMM placed at `addresses` (BAR index,
    /// guest physical address; one entry per probed BAR).
    pub fn new(
        backend: &dyn VfioBackend,
        probe: DeviceProbe,
        addresses: &[(usize, u64)],
    ) -> Result<Self, ShadowError> {
        let mut bars = PciConfiguration::new(PciHeader::default());
        for bar in &probe.bars {
            let addr = addresses
                .iter()
                .find(|(i, _)| *i == bar.index)
                .map(|(_, a)| *a)
                .ok_or(ShadowError::BadBar {
                    index: bar.index,
                    reason: "not placed by the VMM",
                })?;
            bars.add_bar(bar.index, bar.kind, addr, bar.size)?;
        }
        let msi = match probe.msi {
            Some(offset) => {
                // Only the capability's own bytes: it may end at the end of a 256-byte space.
                let mut device = [0u8; 24];
                backend
                    .config_read(offset as u64, &mut device[..4])
                    .map_err(|_| ShadowError::ConfigRead(offset as u64))?;
                let len = msi_cap_len(&[0, 0, device[2], device[3]], 0);
                backend
                    .config_read(offset as u64, &mut device[..len])
                    .map_err(|_| ShadowError::ConfigRead(offset as u64))?;
                Some(MsiCap::new(offset, device))
            }
            None => None,
        };
        Ok(Self {
            bars,
            probe,
            msix_control: 0,
            msi,
        })
    }

    /// What probing found.
    pub fn probe(&self) -> &DeviceProbe {
        &self.probe
    }

    /// The address BAR `index` is mapped at now.
    pub fn bar_address(&self, index: usize) -> Option<u64> {
        self.bars.bar_mapped(index)
    }

    /// The command register as the guest last wrote it.
    pub fn command(&self) -> u16 {
        self.bars.command()
    }

    fn hidden(&self, at: usize) -> Option<&HiddenCap> {
        self.probe
            .hidden
            .iter()
            .find(|h| (h.offset..h.offset + h.len).contains(&at))
    }

    fn in_msi(&self, at: usize) -> Option<usize> {
        let msi = self.msi.as_ref()?;
        if (msi.offset..msi.offset + msi.len).contains(&at) {
            Some(at - msi.offset)
        } else {
            None
        }
    }

    /// Reads register `reg` (a dword index) as the guest sees it.
    pub fn read(&self, backend: &dyn VfioBackend, reg: usize) -> u32 {
        let at = reg * 4;
        if (BAR0_REG..BAR0_REG + 6).contains(&reg) {
            return self.bars.read_reg(reg);
        }
        if reg == ROM_REG {
            return 0;
        }
        if reg >= PCIE_CONFIG_SIZE / 4 {
            return u32::MAX;
        }
        if let Some(cap) = &self.probe.gpudirect {
            if let Some(value) = cap.read_reg(reg) {
                return value;
            }
        }
        if let Some(h) = self.hidden(at) {
            // The null capability: id 0, version 0, the chain continues.
            return if at == h.offset {
                // The next pointer is the header's top 12 bits.
                crate::narrow::low_u32(h.next as u64) << 20
            } else {
                0
            };
        }
        if let (Some(msi), Some(rel)) = (&self.msi, self.in_msi(at)) {
            let b = &msi.bytes[rel..];
            let mut v = [0u8; 4];
            for (i, byte) in v.iter_mut().enumerate() {
                *byte = b.get(i).copied().unwrap_or(0);
            }
            // The dword holding the cap id and next pointer comes from the device.
            if rel == 0 {
                let device = read32(backend, at as u64).unwrap_or(u32::MAX);
                return (device & 0xffff) | (u32::from_le_bytes(v) & 0xffff_0000);
            }
            return u32::from_le_bytes(v);
        }
        let value = read32(backend, at as u64).unwrap_or(u32::MAX);
        match (reg, self.probe.msix) {
            (HEADER_REG, _) => value & HEADER_MF_MASK,
            // The GPUDirect capability heads the list (it points on to the device's head).
            (COMMAND_REG, _) if self.probe.gpudirect.is_some() => value | STATUS_CAP_LIST,
            (CAP_POINTER_REG, _) if self.probe.gpudirect.is_some() => {
                (value & !0xff) | const { crate::narrow::const_u32(GPUDIRECT_CAP_OFFSET as u64) }
            }
            (_, Some(m)) if at == m.cap => {
                (value & 0x3fff_ffff) | (u32::from(self.msix_control & 0xc000) << 16)
            }
            _ => value,
        }
    }

    /// Applies a guest write of `data` (1, 2 or 4 bytes) at byte `offset` of register
    /// `reg`. BAR, ROM, hidden-capability and MSI/MSI-X writes never reach `backend`.
    pub fn write(
        &mut self,
        backend: &dyn VfioBackend,
        reg: usize,
        offset: usize,
        data: &[u8],
    ) -> ShadowWrite {
        let mut out = ShadowWrite::default();
        if reg >= PCIE_CONFIG_SIZE / 4
            || !matches!(data.len(), 1 | 2 | 4)
            || offset + data.len() > 4
        {
            return out;
        }
        let at = reg * 4;
        if (BAR0_REG..BAR0_REG + 6).contains(&reg) {
            out.moves = self.bars.write(reg, offset, data);
            return out;
        }
        if reg == ROM_REG || self.hidden(at).is_some() {
            return out;
        }
        if self.probe.gpudirect.is_some()
            && (GPUDIRECT_CAP_OFFSET..GPUDIRECT_CAP_OFFSET + GPUDIRECT_CAP_LEN).contains(&at)
        {
            // Emulated and read-only: nothing of it exists on the device.
            return out;
        }
        if let Some(m) = self.probe.msix {
            if (m.cap..m.cap + 12).contains(&at) {
                // Only the enable and function-mask bits (byte 3) are writable.
                if at == m.cap && offset + data.len() > 3 {
                    let byte = data[3 - offset];
                    let control = (self.msix_control & 0x3fff) | (u16::from(byte & 0xc0) << 8);
                    if control != self.msix_control {
                        self.msix_control = control;
                        out.irq = Some(IrqChange::Msix { control });
                    }
                }
                return out;
            }
        }
        if let Some(rel) = self.in_msi(at) {
            if let Some(msi) = self.msi.as_mut() {
                let before = msi.state();
                for (i, byte) in data.iter().enumerate() {
                    let k = rel + offset + i;
                    if let (Some(b), Some(w)) = (msi.bytes.get(k).copied(), msi.writable.get(k)) {
                        msi.bytes[k] = (b & !w) | (byte & w);
                    }
                }
                let after = msi.state();
                if after != before {
                    out.irq = Some(after);
                }
            }
            return out;
        }
        if reg == 1 {
            // Command/status: the device needs its decode and bus-master bits; the local
            // copy decides when BAR moves take effect.
            out.moves = self.bars.write(reg, offset, data);
        }
        let _ = backend.config_write((at + offset) as u64, data);
        out
    }

    /// The VMM refused `mv`: the BAR stays mapped at `mv.old`.
    pub fn bar_move_refused(&mut self, mv: &BarMove) {
        self.bars.bar_move_refused(mv);
    }
}

#[cfg(test)]
mod tests {
    use super::super::model::{self, ModelGpu, ModelReset};
    use super::*;

    fn shadow(gpu: &ModelGpu) -> ConfigShadow {
        let probe = probe(gpu).unwrap();
        ConfigShadow::new(
            gpu,
            probe,
            &[(0, 0xc000_0000), (1, 128 << 30), (3, 0x2_0000_0000)],
        )
        .unwrap()
    }

    #[test]
    fn probe_finds_h100_bars_msix_and_caps_to_hide() {
        let gpu = ModelGpu::new(ModelReset::Flr).unwrap();
        let p = probe(&gpu).unwrap();
        let sizes: Vec<_> = p.bars.iter().map(|b| (b.index, b.size)).collect();
        assert_eq!(
            sizes,
            [
                (0, model::BAR0_SIZE),
                (1, model::BAR1_SIZE),
                (3, model::BAR3_SIZE)
            ]
        );
        assert_eq!(p.bars[1].kind, BarKind::Memory64 { prefetchable: true });
        let msix = p.msix.unwrap();
        assert_eq!((msix.table_bar, msix.vectors), (0, model::MSIX_VECTORS));
        assert_eq!(msix.table_offset, u64::from(model::MSIX_TABLE_OFFSET));
        assert_eq!(p.msi, Some(model::cap_offset::MSI));
        let hidden: Vec<_> = p.hidden.iter().map(|h| h.offset).collect();
        assert_eq!(
            hidden,
            [
                model::cap_offset::ARI,
                model::cap_offset::SRIOV,
                model::cap_offset::REBAR
            ]
        );
        // Probing restored every BAR register of the device.
        let mut b = [0u8; 4];
        gpu.config_read(0x18, &mut b).unwrap();
        assert_eq!(u32::from_le_bytes(b), 0);
    }

    #[test]
    fn guest_sees_shadow_bars_no_multifunction_and_null_caps() {
        let gpu = ModelGpu::new(ModelReset::Flr).unwrap();
        let s = shadow(&gpu);
        assert_eq!(s.read(&gpu, 4), 0xc000_0000);
        assert_eq!(s.read(&gpu, 5), 0xc);
        assert_eq!(s.read(&gpu, 6), 32);
        assert_eq!(s.read(&gpu, 3) & 0x0080_0000, 0);
        assert_eq!(s.read(&gpu, 0), 0x2330_10de);
        // The ext chain still walks to the visible DSN cap, through null headers.
        let mut cfg = vec![0u8; 4096];
        for reg in 0..1024 {
            cfg[reg * 4..reg * 4 + 4].copy_from_slice(&s.read(&gpu, reg).to_le_bytes());
        }
        let ids: Vec<_> = walk_ext_caps(&cfg).iter().map(|c| c.id).collect();
        assert_eq!(ids, [0x0001, 0, 0, 0, 0x0003]);
        // The SR-IOV body (TotalVFs) reads zero.
        assert_eq!(s.read(&gpu, (model::cap_offset::SRIOV + 0x0c) / 4), 0);
    }

    #[test]
    fn bar_probe_and_move_stay_in_the_shadow() {
        let gpu = ModelGpu::new(ModelReset::Flr).unwrap();
        let mut s = shadow(&gpu);
        gpu.take_config_writes();
        s.write(&gpu, 4, 0, &u32::MAX.to_le_bytes());
        assert_eq!(
            s.read(&gpu, 4),
            !(u32::try_from(model::BAR0_SIZE).unwrap() - 1)
        );
        s.write(&gpu, 4, 0, &0xd000_0000u32.to_le_bytes());
        let w = s.write(&gpu, 1, 0, &2u16.to_le_bytes());
        assert_eq!(w.moves.len(), 1);
        assert_eq!((w.moves[0].old, w.moves[0].new), (0xc000_0000, 0xd000_0000));
        // Only the command register reached the device.
        assert_eq!(gpu.take_config_writes(), vec![(4, 2)]);
    }

    #[test]
    fn gpudirect_clique_heads_the_guests_capability_list() {
        let gpu = ModelGpu::new(ModelReset::Flr).unwrap();
        let mut p = probe(&gpu).unwrap();
        p.gpudirect = Some(GpuDirectCap::for_device(&gpu, 7).unwrap());
        let mut s = ConfigShadow::new(
            &gpu,
            p,
            &[(0, 0xc000_0000), (1, 128 << 30), (3, 0x2_0000_0000)],
        )
        .unwrap();
        let mut cfg = vec![0u8; 256];
        for reg in 0..64 {
            cfg[reg * 4..reg * 4 + 4].copy_from_slice(&s.read(&gpu, reg).to_le_bytes());
        }
        let caps: Vec<_> = walk_caps(&cfg).iter().map(|c| (c.id, c.offset)).collect();
        assert_eq!(
            caps,
            [
                (0x09, 0xd4),
                (0x01, 0x60),
                (0x05, model::cap_offset::MSI),
                (0x10, 0x78),
                (0x11, model::cap_offset::MSIX)
            ]
        );
        assert_eq!(
            &cfg[0xd4..0xdc],
            &[0x09, 0x60, 8, b'P', b'2', b'P', 7 << 3, 0]
        );
        // Writes to it are dropped; the device never had it.
        gpu.take_config_writes();
        s.write(&gpu, 0xd4 / 4, 0, &u32::MAX.to_le_bytes());
        s.write(&gpu, 0xd8 / 4, 2, &[0xff]);
        assert!(gpu.take_config_writes().is_empty());
        assert_eq!(s.read(&gpu, 0xd8 / 4), 0x0038_5032);
        // Without it, the device's own list.
        let s = shadow(&gpu);
        assert_eq!(s.read(&gpu, 0x34 / 4) & 0xff, 0x60);
        assert_eq!(s.read(&gpu, 0xd4 / 4), 0);
    }

    #[test]
    fn msix_and_msi_writes_become_irq_changes() {
        let gpu = ModelGpu::new(ModelReset::Flr).unwrap();
        let mut s = shadow(&gpu);
        gpu.take_config_writes();
        let cap = model::cap_offset::MSIX;
        let w = s.write(&gpu, cap / 4, 2, &0x8000u16.to_le_bytes());
        assert_eq!(w.irq, Some(IrqChange::Msix { control: 0x8000 }));
        assert_eq!(
            s.read(&gpu, cap / 4) >> 16,
            0x8000 | u32::from(model::MSIX_VECTORS - 1)
        );
        let msi = model::cap_offset::MSI;
        s.write(&gpu, msi / 4 + 1, 0, &0xfee0_0000u32.to_le_bytes());
        s.write(&gpu, msi / 4 + 3, 0, &0x41u32.to_le_bytes());
        let w = s.write(&gpu, msi / 4, 2, &[1]);
        assert_eq!(
            w.irq,
            Some(IrqChange::Msi {
                enabled: true,
                message: MsiMessage {
                    address: 0xfee0_0000,
                    data: 0x41
                },
                masked: false
            })
        );
        assert!(gpu.take_config_writes().is_empty());
    }
}

#[cfg(test)]
mod proptests {
    use proptest::prelude::*;

    use super::super::model::{ModelGpu, ModelReset};
    use super::*;

    /// BAR registers 0x10-0x27 and the ROM BAR 0x30-0x33 of the device.
    fn hits_bar_or_rom(offset: u64, len: usize) -> bool {
        let end = offset + len as u64;
        offset < 0x28 && end > 0x10 || offset < 0x34 && end > 0x30
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(256))]
        #[test]
        fn no_guest_config_write_reaches_a_bar_or_rom_register(
            writes in proptest::collection::vec(
                (0usize..1100, 0usize..4, prop_oneof![Just(1usize), Just(2), Just(4), Just(3)],
                 any::<u32>(), any::<bool>()),
                1..64,
            )
        ) {
            let gpu = ModelGpu::new(ModelReset::Flr).unwrap();
            let p = probe(&gpu).unwrap();
            let mut s = ConfigShadow::new(
                &gpu, p, &[(0, 0xc000_0000), (1, 128 << 30), (3, 0x2_0000_0000)],
            ).unwrap();
            gpu.take_config_writes();
            for (reg, offset, len, value, near_bars) in writes {
                // Half the writes aim at the header, where the BARs are.
                let reg = if near_bars { reg % 16 } else { reg };
                let bytes = value.to_le_bytes();
                let data = &bytes[..len.min(4)];
                s.write(&gpu, reg, offset, data);
                // Reads never panic either.
                s.read(&gpu, reg);
            }
            for (offset, len) in gpu.take_config_writes() {
                prop_assert!(!hits_bar_or_rom(offset, len), "device got a write at {offset:#x}+{len}");
            }
            // The device's BAR registers still hold what probing restored.
            let mut b = [0u8; 4];
            gpu.config_read(0x10, &mut b).unwrap();
            prop_assert_eq!(u32::from_le_bytes(b), 0);
        }
    }
}
