//! A software model of a GPU behind the [`VfioBackend`] seam, shaped like an NVIDIA H100
//! (PCI 10de:2330, class 0302): BAR0 16 MiB of registers with the MSI-X table and PBA at
//! offsets that are not page aligned, BAR1 128 GiB 64-bit prefetchable (a sparse memfd:
//! nothing is allocated until written), BAR3 32 MiB 64-bit prefetchable, MSI, MSI-X with
//! 16 vectors, and the SR-IOV, Resizable BAR and ARI extended capabilities a real PF has.
//!
//! It is a fake for tests and benchmarks, never for tenants. Its first BAR0 page is a
//! register page the VMM traps (the model's sparse-mmap capability leaves it out):
//!
//! | offset | register |
//! |--------|----------|
//! | 0x000  | `BOOT_0` (read-only id, [`MODEL_BOOT_0`]) |
//! | 0x004  | scratch (read/write) |
//! | 0x008  | write N: raise interrupt vector N (MSI-X, else MSI, else INTx) |
//! | 0x00c  | interrupts raised (read-only) |
//! | 0x010/0x014 | DMA address, low/high |
//! | 0x018  | DMA length in bytes (at most 4096) |
//! | 0x01c  | DMA fill pattern (a dword, repeated) |
//! | 0x020  | write 1: start the DMA (needs bus mastering on) |
//! | 0x024  | DMA status: 0 idle, 1 done, 2 failed, 3 bus mastering off |

use std::fs::File;
use std::os::fd::{AsFd, FromRawFd};
use std::os::unix::fs::FileExt;
use std::sync::{Arc, Mutex, PoisonError};

use tenantvm_vmm_api::ResetOutcome;
use vmm_sys_util::eventfd::EventFd;

use super::backend::{
    region_index, IrqIndex, IrqInfo, MmapSource, RegionInfo, VfioBackend, VfioBackendError,
    REGION_FLAG_MMAP, REGION_FLAG_READ, REGION_FLAG_WRITE,
};
use super::region_caps::{RegionCap, SparseArea};

/// Vendor id of the model (NVIDIA).
pub const MODEL_VENDOR: u16 = 0x10de;
/// Device id of the model (H100 SXM5 80GB).
pub const MODEL_DEVICE: u16 = 0x2330;
/// What the model's `BOOT_0` register reads.
pub const MODEL_BOOT_0: u32 = 0x1800_00a1;
/// BAR0 size.
pub const BAR0_SIZE: u64 = 16 << 20;
/// BAR1 size.
pub const BAR1_SIZE: u64 = 128 << 30;
/// BAR3 size.
pub const BAR3_SIZE: u64 = 32 << 20;
/// MSI-X vectors.
pub const MSIX_VECTORS: u16 = 16;
/// Offset of the MSI-X table in BAR0 (not page aligned, on purpose).
pub const MSIX_TABLE_OFFSET: u32 = 0x00b9_0200;
/// Offset of the MSI-X PBA in BAR0 (not page aligned, on purpose).
pub const MSIX_PBA_OFFSET: u32 = 0x00ba_0100;
/// Offsets of the model's capabilities.
pub mod cap_offset {
    /// MSI.
    pub const MSI: usize = 0x68;
    /// MSI-X.
    pub const MSIX: usize = 0xb4;
    /// ARI (extended).
    pub const ARI: usize = 0x148;
    /// SR-IOV (extended).
    pub const SRIOV: usize = 0x150;
    /// Resizable BAR (extended).
    pub const REBAR: usize = 0x190;
    /// Device serial number (extended; stays visible).
    pub const DSN: usize = 0x1a0;
}
/// Model registers (offsets in BAR0).
pub mod reg {
    /// Read-only id.
    pub const BOOT_0: u64 = 0x000;
    /// Scratch.
    pub const SCRATCH: u64 = 0x004;
    /// Raise a vector.
    pub const IRQ_RAISE: u64 = 0x008;
    /// Interrupts raised.
    pub const IRQ_COUNT: u64 = 0x00c;
    /// DMA address low.
    pub const DMA_ADDR_LO: u64 = 0x010;
    /// DMA address high.
    pub const DMA_ADDR_HI: u64 = 0x014;
    /// DMA length.
    pub const DMA_LEN: u64 = 0x018;
    /// DMA pattern.
    pub const DMA_PATTERN: u64 = 0x01c;
    /// DMA start.
    pub const DMA_GO: u64 = 0x020;
    /// DMA status.
    pub const DMA_STATUS: u64 = 0x024;
}
const REG_PAGE: u64 = 0x1000;
const CONFIG_SIZE: usize = 0x1000;
const MAX_DMA: u32 = 4096;

/// What the model does when asked to reset.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ModelReset {
    /// A function-level reset that works.
    Flr,
    /// No reset mechanism (like QEMU's edu device).
    None,
    /// The reset fails.
    Failing,
}

/// Writes `data` at guest physical address `gpa` on the model's behalf (the VMM's guest
/// memory, standing in for the IOMMU mapping IOVA = GPA).
pub type DmaHandler = Arc<dyn Fn(u64, &[u8]) -> Result<(), String> + Send + Sync>;

struct State {
    config: Vec<u8>,
    /// Every configuration write the device received: (offset, length).
    config_writes: Vec<(u64, usize)>,
    regs: [u32; 10],
    irqs: [Vec<EventFd>; 3],
    resets: u32,
}

/// The model GPU. A fake for tests: see the module documentation.
pub struct ModelGpu {
    state: Mutex<State>,
    bars: [Option<File>; 6],
    reset_mode: ModelReset,
    dma: Mutex<Option<DmaHandler>>,
}

fn memfd(name: &std::ffi::CStr, size: u64) -> std::io::Result<File> {
    // SAFETY: `name` is a valid C string; the call has no memory-safety preconditions.
    let fd = unsafe { libc::memfd_create(name.as_ptr(), libc::MFD_CLOEXEC) };
    if fd < 0 {
        return Err(std::io::Error::last_os_error());
    }
    // SAFETY: `fd` is a fresh descriptor that nothing else owns.
    let file = unsafe { File::from_raw_fd(fd) };
    file.set_len(size)?;
    Ok(file)
}

fn put(cfg: &mut [u8], at: usize, bytes: &[u8]) {
    cfg[at..at + bytes.len()].copy_from_slice(bytes);
}

fn ext_header(id: u16, next: usize) -> [u8; 4] {
    // The next pointer is the header's top 12 bits.
    (u32::from(id) | (1 << 16) | (crate::narrow::low_u32(next as u64) << 20)).to_le_bytes()
}

fn initial_config() -> Vec<u8> {
    let mut c = vec![0u8; CONFIG_SIZE];
    put(&mut c, 0x00, &MODEL_VENDOR.to_le_bytes());
    put(&mut c, 0x02, &MODEL_DEVICE.to_le_bytes());
    put(&mut c, 0x06, &0x0010u16.to_le_bytes()); // capability list
    put(&mut c, 0x08, &[0xa1, 0x00, 0x02, 0x03]); // rev, prog-if, 3D controller
    c[0x0e] = 0x80; // multi-function bit set: the shadow must mask it
    put(&mut c, 0x10, &0u32.to_le_bytes()); // BAR0 mem32
    put(&mut c, 0x14, &0xcu32.to_le_bytes()); // BAR1 mem64 prefetchable
    put(&mut c, 0x1c, &0xcu32.to_le_bytes()); // BAR3 mem64 prefetchable
    put(&mut c, 0x2c, &[0xde, 0x10, 0xc1, 0x16]);
    c[0x34] = 0x60;
    c[0x3d] = 1; // INTA
                 // PM
    put(&mut c, 0x60, &[0x01, 0x68, 0x03, 0x00]);
    // MSI: 64-bit, one vector
    put(&mut c, cap_offset::MSI, &[0x05, 0x78, 0x80, 0x00]);
    // PCIe endpoint
    put(
        &mut c,
        0x78,
        &[
            0x10,
            const { crate::narrow::const_u8(cap_offset::MSIX as u64) },
            0x02,
            0x00,
        ],
    );
    // MSI-X: 16 vectors, table and PBA in BAR0
    put(&mut c, cap_offset::MSIX, &[0x11, 0x00]);
    put(
        &mut c,
        cap_offset::MSIX + 2,
        &(MSIX_VECTORS - 1).to_le_bytes(),
    );
    put(
        &mut c,
        cap_offset::MSIX + 4,
        &MSIX_TABLE_OFFSET.to_le_bytes(),
    );
    put(&mut c, cap_offset::MSIX + 8, &MSIX_PBA_OFFSET.to_le_bytes());
    // Extended: AER -> ARI -> SR-IOV -> ReBAR -> DSN
    put(&mut c, 0x100, &ext_header(0x0001, cap_offset::ARI));
    put(
        &mut c,
        cap_offset::ARI,
        &ext_header(0x000e, cap_offset::SRIOV),
    );
    put(&mut c, cap_offset::ARI + 4, &0x0100u32.to_le_bytes());
    put(
        &mut c,
        cap_offset::SRIOV,
        &ext_header(0x0010, cap_offset::REBAR),
    );
    put(&mut c, cap_offset::SRIOV + 0x0e, &32u16.to_le_bytes()); // TotalVFs
    put(
        &mut c,
        cap_offset::SRIOV + 0x24,
        &0x0000_000cu32.to_le_bytes(),
    ); // VF BAR0
    put(
        &mut c,
        cap_offset::REBAR,
        &ext_header(0x0015, cap_offset::DSN),
    );
    put(&mut c, cap_offset::REBAR + 4, &0x0003_fff0u32.to_le_bytes()); // sizes 1M..128G
                                                                       // BAR 1, one resizable BAR, current size 2^17 MiB = 128 GiB
    put(
        &mut c,
        cap_offset::REBAR + 8,
        &(1u32 | (1 << 5) | (17 << 8)).to_le_bytes(),
    );
    put(&mut c, cap_offset::DSN, &ext_header(0x0003, 0));
    put(&mut c, cap_offset::DSN + 4, &0x4d4f_4445u32.to_le_bytes());
    c
}

/// Size of BAR `index` of the model (0 when absent).
fn bar_size(index: usize) -> u64 {
    match index {
        0 => BAR0_SIZE,
        1 => BAR1_SIZE,
        3 => BAR3_SIZE,
        _ => 0,
    }
}

/// The writable bits of BAR register `reg` (4-9): the address bits of the BAR (or of the
/// high half of a 64-bit BAR) it holds.
fn bar_reg_mask(reg: usize) -> u32 {
    let low = |size: u64| crate::narrow::low_u32(!(size - 1)) & !0xf;
    let high = |size: u64| (!(size - 1) >> 32) as u32;
    match reg {
        4 => low(BAR0_SIZE),
        5 => low(BAR1_SIZE),
        6 => high(BAR1_SIZE),
        7 => low(BAR3_SIZE),
        8 => high(BAR3_SIZE),
        _ => 0,
    }
}

fn page_down(x: u64) -> u64 {
    x & !0xfff
}

impl ModelGpu {
    /// A model GPU whose reset behaves as `reset_mode`.
    pub fn new(reset_mode: ModelReset) -> std::io::Result<Self> {
        let bars = [
            Some(memfd(c"tenantvm-model-bar0", BAR0_SIZE)?),
            Some(memfd(c"tenantvm-model-bar1", BAR1_SIZE)?),
            None,
            Some(memfd(c"tenantvm-model-bar3", BAR3_SIZE)?),
            None,
            None,
        ];
        Ok(Self {
            state: Mutex::new(State {
                config: initial_config(),
                config_writes: Vec::new(),
                regs: [0; 10],
                irqs: [Vec::new(), Vec::new(), Vec::new()],
                resets: 0,
            }),
            bars,
            reset_mode,
            dma: Mutex::new(None),
        })
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Sets where the model's DMA writes go.
    pub fn set_dma_handler(&self, handler: DmaHandler) {
        *self.dma.lock().unwrap_or_else(PoisonError::into_inner) = Some(handler);
    }

    /// Takes the record of configuration writes the device received so far.
    pub fn take_config_writes(&self) -> Vec<(u64, usize)> {
        std::mem::take(&mut self.lock().config_writes)
    }

    /// How many resets the device went through.
    pub fn resets(&self) -> u32 {
        self.lock().resets
    }

    /// Raises interrupt `vector` as the device would: on the MSI-X eventfd if MSI-X is
    /// enabled, else MSI, else INTx. Returns whether an eventfd was signalled.
    pub fn raise(&self, vector: u32) -> bool {
        let mut st = self.lock();
        Self::raise_locked(&mut st, vector)
    }

    fn raise_locked(st: &mut State, vector: u32) -> bool {
        let fd = [IrqIndex::Msix, IrqIndex::Msi, IrqIndex::Intx]
            .into_iter()
            .map(|i| &st.irqs[i.vfio_index() as usize])
            .find(|fds| !fds.is_empty())
            .and_then(|fds| fds.get(vector as usize));
        let raised = fd.is_some_and(|fd| fd.write(1).is_ok());
        if raised {
            st.regs[(reg::IRQ_COUNT / 4) as usize] += 1;
        }
        raised
    }

    fn command(st: &State) -> u16 {
        u16::from_le_bytes([st.config[4], st.config[5]])
    }

    fn run_dma(&self, st: &mut State) -> u32 {
        if Self::command(st) & 0x4 == 0 {
            return 3;
        }
        let r = |o: u64| st.regs[(o / 4) as usize];
        let addr = u64::from(r(reg::DMA_ADDR_LO)) | (u64::from(r(reg::DMA_ADDR_HI)) << 32);
        let len = r(reg::DMA_LEN).min(MAX_DMA) as usize;
        let bytes: Vec<u8> = r(reg::DMA_PATTERN)
            .to_le_bytes()
            .into_iter()
            .cycle()
            .take(len)
            .collect();
        let handler = self
            .dma
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .clone();
        match handler.map(|h| h(addr, &bytes)) {
            Some(Ok(())) => 1,
            _ => 2,
        }
    }

    fn reg_read(st: &State, offset: u64) -> u32 {
        match offset {
            reg::BOOT_0 => MODEL_BOOT_0,
            o if o < 0x28 => st.regs[(o / 4) as usize],
            _ => 0,
        }
    }

    fn reg_write(&self, st: &mut State, offset: u64, value: u32) {
        match offset {
            reg::SCRATCH
            | reg::DMA_ADDR_LO
            | reg::DMA_ADDR_HI
            | reg::DMA_LEN
            | reg::DMA_PATTERN => st.regs[(offset / 4) as usize] = value,
            reg::IRQ_RAISE => {
                Self::raise_locked(st, value);
            }
            reg::DMA_GO if value == 1 => {
                let status = self.run_dma(st);
                st.regs[(reg::DMA_STATUS / 4) as usize] = status;
            }
            _ => {}
        }
    }

    fn config_write_locked(st: &mut State, offset: u64, data: &[u8]) {
        st.config_writes.push((offset, data.len()));
        // The caller kept the write inside the 4 KiB space.
        let Ok(offset) = usize::try_from(offset) else {
            return;
        };
        for (i, byte) in data.iter().enumerate() {
            let at = offset + i;
            let reg = at / 4;
            let shift = (at % 4) * 8;
            let writable: u32 = match reg {
                1 => 0x0000_0507, // command: io, mem, bus master, intx disable
                3 => 0x0000_ffff,
                4..=9 => bar_reg_mask(reg),
                15 => 0xff,
                _ => 0,
            };
            let mask = ((writable >> shift) & 0xff) as u8;
            st.config[at] = (st.config[at] & !mask) | (byte & mask);
        }
    }
}

impl VfioBackend for ModelGpu {
    fn region_info(&self, index: u32) -> Option<RegionInfo> {
        let rw = REGION_FLAG_READ | REGION_FLAG_WRITE;
        let info = match index {
            0 => RegionInfo {
                size: BAR0_SIZE,
                flags: rw | REGION_FLAG_MMAP,
                caps: vec![RegionCap::SparseMmap(vec![
                    SparseArea {
                        offset: REG_PAGE,
                        size: page_down(u64::from(MSIX_TABLE_OFFSET)) - REG_PAGE,
                    },
                    SparseArea {
                        offset: page_down(u64::from(MSIX_TABLE_OFFSET)) + 0x1000,
                        size: page_down(u64::from(MSIX_PBA_OFFSET))
                            - page_down(u64::from(MSIX_TABLE_OFFSET))
                            - 0x1000,
                    },
                    SparseArea {
                        offset: page_down(u64::from(MSIX_PBA_OFFSET)) + 0x1000,
                        size: BAR0_SIZE - page_down(u64::from(MSIX_PBA_OFFSET)) - 0x1000,
                    },
                ])],
            },
            1 | 3 => RegionInfo {
                size: bar_size(index as usize),
                flags: rw | REGION_FLAG_MMAP,
                caps: Vec::new(),
            },
            2 | 4 | 5 | region_index::ROM => RegionInfo {
                size: 0,
                flags: 0,
                caps: Vec::new(),
            },
            region_index::CONFIG => RegionInfo {
                size: CONFIG_SIZE as u64,
                flags: rw,
                caps: Vec::new(),
            },
            _ => return None,
        };
        Some(info)
    }

    fn region_read(
        &self,
        index: u32,
        offset: u64,
        data: &mut [u8],
    ) -> Result<(), VfioBackendError> {
        let oob = VfioBackendError::Access {
            index,
            offset,
            len: data.len(),
        };
        let size = self
            .region_info(index)
            .ok_or(VfioBackendError::NoRegion(index))?
            .size;
        if offset
            .checked_add(data.len() as u64)
            .is_none_or(|end| end > size)
        {
            return Err(oob);
        }
        let st = self.lock();
        if index == region_index::CONFIG {
            let at = usize::try_from(offset).map_err(|_| oob)?;
            data.copy_from_slice(&st.config[at..at + data.len()]);
            return Ok(());
        }
        if index == 0 && offset < REG_PAGE {
            let value = Self::reg_read(&st, offset & !3).to_le_bytes();
            let start = (offset % 4) as usize;
            for (i, b) in data.iter_mut().enumerate() {
                *b = value.get(start + i).copied().unwrap_or(0);
            }
            return Ok(());
        }
        let file = self.bars[index as usize].as_ref().ok_or(oob)?;
        file.read_exact_at(data, offset)
            .map_err(|source| VfioBackendError::Os {
                op: "model BAR read",
                source,
            })
    }

    fn region_write(&self, index: u32, offset: u64, data: &[u8]) -> Result<(), VfioBackendError> {
        let oob = VfioBackendError::Access {
            index,
            offset,
            len: data.len(),
        };
        let size = self
            .region_info(index)
            .ok_or(VfioBackendError::NoRegion(index))?
            .size;
        if offset
            .checked_add(data.len() as u64)
            .is_none_or(|end| end > size)
        {
            return Err(oob);
        }
        let mut st = self.lock();
        if index == region_index::CONFIG {
            Self::config_write_locked(&mut st, offset, data);
            return Ok(());
        }
        if index == 0 && offset < REG_PAGE {
            if data.len() == 4 && offset % 4 == 0 {
                let value = u32::from_le_bytes([data[0], data[1], data[2], data[3]]);
                self.reg_write(&mut st, offset, value);
            }
            return Ok(());
        }
        let file = self.bars[index as usize].as_ref().ok_or(oob)?;
        file.write_all_at(data, offset)
            .map_err(|source| VfioBackendError::Os {
                op: "model BAR write",
                source,
            })
    }

    fn region_mmap(&self, index: u32) -> Option<MmapSource<'_>> {
        let file = self.bars.get(index as usize)?.as_ref()?;
        Some(MmapSource {
            fd: file.as_fd(),
            offset: 0,
        })
    }

    fn irq_info(&self, index: IrqIndex) -> Option<IrqInfo> {
        let count = match index {
            IrqIndex::Intx | IrqIndex::Msi => 1,
            IrqIndex::Msix => u32::from(MSIX_VECTORS),
        };
        Some(IrqInfo { count, flags: 0 })
    }

    fn irq_enable(&self, index: IrqIndex, fds: &[&EventFd]) -> Result<(), VfioBackendError> {
        let offered = self.irq_info(index).map_or(0, |i| i.count);
        if fds.len() > offered as usize {
            return Err(VfioBackendError::Irq {
                index,
                asked: fds.len(),
                offered,
            });
        }
        let clones = fds
            .iter()
            .map(|fd| fd.try_clone())
            .collect::<Result<Vec<_>, _>>()
            .map_err(|source| VfioBackendError::Os {
                op: "model eventfd clone",
                source,
            })?;
        self.lock().irqs[index.vfio_index() as usize] = clones;
        Ok(())
    }

    fn irq_disable(&self, index: IrqIndex) -> Result<(), VfioBackendError> {
        self.lock().irqs[index.vfio_index() as usize].clear();
        Ok(())
    }

    fn irq_unmask(&self, _index: IrqIndex) -> Result<(), VfioBackendError> {
        Ok(())
    }

    /// The model's INTx is never masked (it raises edges), so there is nothing to unmask.
    fn irq_unmask_on(&self, _index: IrqIndex, _fd: &EventFd) -> Result<(), VfioBackendError> {
        Ok(())
    }

    fn reset(&self) -> ResetOutcome {
        match self.reset_mode {
            ModelReset::Flr => {
                let mut st = self.lock();
                st.resets += 1;
                // An FLR clears the command register and the device's own state; BAR
                // contents (device memory) survive, as on real hardware.
                st.config[4] = 0;
                st.config[5] = 0;
                st.regs = [0; 10];
                ResetOutcome::Reset {
                    method: Some("flr".into()),
                }
            }
            ModelReset::None => ResetOutcome::Unsupported,
            ModelReset::Failing => ResetOutcome::Failed {
                error: "model GPU: reset failed (as configured)".into(),
            },
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cfg32(gpu: &ModelGpu, at: u64) -> u32 {
        let mut b = [0u8; 4];
        gpu.config_read(at, &mut b).unwrap();
        u32::from_le_bytes(b)
    }

    #[test]
    fn bars_probe_to_h100_sizes() {
        let gpu = ModelGpu::new(ModelReset::Flr).unwrap();
        for reg in [0x10u64, 0x14, 0x18, 0x1c, 0x20, 0x24] {
            gpu.config_write(reg, &u32::MAX.to_le_bytes()).unwrap();
        }
        assert_eq!(cfg32(&gpu, 0x10), !(u32::try_from(BAR0_SIZE).unwrap() - 1));
        let bar1 = u64::from(cfg32(&gpu, 0x14) & !0xf) | (u64::from(cfg32(&gpu, 0x18)) << 32);
        assert_eq!(!bar1 + 1, BAR1_SIZE);
        assert_eq!(cfg32(&gpu, 0x14) & 0xf, 0xc);
        let bar3 = u64::from(cfg32(&gpu, 0x1c) & !0xf) | (u64::from(cfg32(&gpu, 0x20)) << 32);
        assert_eq!(!bar3 + 1, BAR3_SIZE);
        assert_eq!(cfg32(&gpu, 0x24), 0);
    }

    #[test]
    fn register_page_raises_interrupts_and_dmas() {
        let gpu = ModelGpu::new(ModelReset::Flr).unwrap();
        let fd = EventFd::new(libc::EFD_NONBLOCK).unwrap();
        let fd3 = EventFd::new(libc::EFD_NONBLOCK).unwrap();
        gpu.irq_enable(IrqIndex::Msix, &[&fd, &fd, &fd, &fd3])
            .unwrap();
        gpu.region_write(0, reg::IRQ_RAISE, &3u32.to_le_bytes())
            .unwrap();
        assert_eq!(fd3.read().unwrap(), 1);
        let written = Arc::new(Mutex::new(Vec::new()));
        let sink = written.clone();
        gpu.set_dma_handler(Arc::new(move |gpa, bytes| {
            sink.lock().unwrap().push((gpa, bytes.to_vec()));
            Ok(())
        }));
        for (r, v) in [
            (reg::DMA_ADDR_LO, 0x1000u32),
            (reg::DMA_LEN, 8),
            (reg::DMA_PATTERN, 0xaabb_ccdd),
            (reg::DMA_GO, 1),
        ] {
            gpu.region_write(0, r, &v.to_le_bytes()).unwrap();
        }
        // Bus mastering is off: no DMA.
        let mut status = [0u8; 4];
        gpu.region_read(0, reg::DMA_STATUS, &mut status).unwrap();
        assert_eq!(u32::from_le_bytes(status), 3);
        gpu.config_write(4, &4u16.to_le_bytes()).unwrap();
        gpu.region_write(0, reg::DMA_GO, &1u32.to_le_bytes())
            .unwrap();
        gpu.region_read(0, reg::DMA_STATUS, &mut status).unwrap();
        assert_eq!(u32::from_le_bytes(status), 1);
        let dd = 0xaabb_ccddu32.to_le_bytes();
        assert_eq!(*written.lock().unwrap(), vec![(0x1000, [dd, dd].concat())]);
    }

    #[test]
    fn bar1_is_a_sparse_128_gib_memfd() {
        let gpu = ModelGpu::new(ModelReset::Flr).unwrap();
        let far = BAR1_SIZE - 8;
        gpu.region_write(1, far, &[7; 8]).unwrap();
        let mut back = [0u8; 8];
        gpu.region_read(1, far, &mut back).unwrap();
        assert_eq!(back, [7; 8]);
        assert!(gpu.region_read(1, BAR1_SIZE - 4, &mut back).is_err());
        assert!(gpu.region_mmap(1).is_some());
    }

    #[test]
    fn reset_modes_report_their_outcome() {
        let gpu = ModelGpu::new(ModelReset::Flr).unwrap();
        gpu.config_write(4, &6u16.to_le_bytes()).unwrap();
        assert!(gpu.reset().cleared());
        assert_eq!(cfg32(&gpu, 4) & 0xffff, 0);
        assert_eq!(gpu.resets(), 1);
        assert_eq!(
            ModelGpu::new(ModelReset::None).unwrap().reset(),
            ResetOutcome::Unsupported
        );
        assert!(!ModelGpu::new(ModelReset::Failing)
            .unwrap()
            .reset()
            .cleared());
    }
}
