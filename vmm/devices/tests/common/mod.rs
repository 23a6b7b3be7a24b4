//! A simulated guest for end-to-end device tests: the PCI platform wired as the VMM
//! wires it (buses, root, BAR allocator, device event loop), and a minimal virtio-pci
//! driver that talks to it only through port I/O, MMIO and guest memory.

#![allow(dead_code)]

use std::sync::{Arc, Mutex};

use tenantvm_devices::bus::Bus;
use tenantvm_devices::pci::{
    BarAllocator, BarKind, BarMove, BarRelocation, BarRelocationError, MsiInterruptSink,
    MsiMessage, MsiSinkError, PciBarWindow, PciConfigIo, PciConfigMmio, PciRoot, PciWindows,
    ECAM_BASE, ECAM_BUS_SIZE, MMIO64_DEFAULT_SIZE,
};
use tenantvm_devices::virtio::transport::{VirtioPciDevice, BAR_SIZE};
use tenantvm_devices::virtio::{EventLoopThread, GuestMemoryMmap, VirtioDevice};
use vm_memory::{Bytes, GuestAddress};

pub const MEM_SIZE: u64 = 0x100_0000;

/// A fake MSI sink for tests: records every interrupt.
#[derive(Default)]
pub struct FakeMsiSink {
    pub fired: Mutex<Vec<(u16, MsiMessage)>>,
}

impl MsiInterruptSink for FakeMsiSink {
    fn update(
        &self,
        _vector: u16,
        _message: MsiMessage,
        _masked: bool,
    ) -> Result<(), MsiSinkError> {
        Ok(())
    }
    fn trigger(&self, vector: u16, message: MsiMessage) -> Result<(), MsiSinkError> {
        self.fired.lock().unwrap().push((vector, message));
        Ok(())
    }
}

/// Moves BAR mappings on the MMIO bus, as the VMM's relocation handler does.
pub struct BusRelocation {
    pub mmio: Arc<Mutex<Bus>>,
    pub alloc: Arc<Mutex<BarAllocator>>,
}

impl BarRelocation for BusRelocation {
    fn move_bar(&self, _slot: u8, mv: &BarMove) -> Result<(), BarRelocationError> {
        self.alloc
            .lock()
            .unwrap()
            .relocate(mv.kind, mv.old, mv.new, mv.size)
            .map_err(|_| BarRelocationError::Range {
                addr: mv.new,
                size: mv.size,
            })?;
        let mut bus = self.mmio.lock().unwrap();
        let device = bus
            .remove(mv.old)
            .ok_or(BarRelocationError::Remap("not mapped".into()))?;
        bus.insert(device, mv.new, mv.size)
            .map_err(|e| BarRelocationError::Remap(e.to_string()))
    }
}

pub struct Platform {
    pub mem: GuestMemoryMmap,
    pub mmio: Arc<Mutex<Bus>>,
    pub pio: Bus,
    pub root: Arc<Mutex<PciRoot>>,
    pub sink: Arc<FakeMsiSink>,
    pub event_loop: Arc<EventLoopThread>,
    pub alloc: Arc<Mutex<BarAllocator>>,
}

impl Platform {
    pub fn new() -> Self {
        let mem = GuestMemoryMmap::from_ranges(&[(GuestAddress(0), MEM_SIZE as usize)]).unwrap();
        let windows = PciWindows::new(MEM_SIZE, 46, MMIO64_DEFAULT_SIZE).unwrap();
        let alloc = Arc::new(Mutex::new(BarAllocator::new(windows).unwrap()));
        let mmio = Arc::new(Mutex::new(Bus::new()));
        let relocation = Arc::new(BusRelocation {
            mmio: mmio.clone(),
            alloc: alloc.clone(),
        });
        let root = Arc::new(Mutex::new(PciRoot::new(Some(relocation))));
        mmio.lock()
            .unwrap()
            .insert(
                Arc::new(Mutex::new(PciConfigMmio::new(root.clone()))),
                ECAM_BASE,
                ECAM_BUS_SIZE,
            )
            .unwrap();
        let mut pio = Bus::new();
        pio.insert(
            Arc::new(Mutex::new(PciConfigIo::new(root.clone()))),
            0xcf8,
            8,
        )
        .unwrap();
        Self {
            mem,
            mmio,
            pio,
            root,
            sink: Arc::new(FakeMsiSink::default()),
            event_loop: Arc::new(EventLoopThread::spawn("test-dev").unwrap()),
            alloc,
        }
    }

    /// Plugs a virtio device in; returns its slot.
    pub fn add_virtio(&self, device: Box<dyn VirtioDevice>) -> u8 {
        let bar = self
            .alloc
            .lock()
            .unwrap()
            .allocate(
                BarKind::Memory64 {
                    prefetchable: false,
                },
                BAR_SIZE,
            )
            .unwrap();
        let dev = VirtioPciDevice::new(
            device,
            self.mem.clone(),
            self.sink.clone(),
            self.event_loop.clone(),
            bar,
        )
        .unwrap();
        let dev = Arc::new(Mutex::new(dev));
        let slot = self.root.lock().unwrap().add_device(dev.clone()).unwrap();
        self.mmio
            .lock()
            .unwrap()
            .insert(
                Arc::new(Mutex::new(PciBarWindow::new(dev, 0))),
                bar,
                BAR_SIZE,
            )
            .unwrap();
        slot
    }

    pub fn cfg_read(&self, slot: u8, offset: u8) -> u32 {
        let addr = 0x8000_0000u32 | (u32::from(slot) << 11) | u32::from(offset & 0xfc);
        self.pio.write(0xcf8, &addr.to_le_bytes());
        let mut data = [0u8; 4];
        self.pio.read(0xcfc, &mut data);
        u32::from_le_bytes(data)
    }

    pub fn cfg_write(&self, slot: u8, offset: u8, value: u32) {
        let addr = 0x8000_0000u32 | (u32::from(slot) << 11) | u32::from(offset & 0xfc);
        self.pio.write(0xcf8, &addr.to_le_bytes());
        self.pio.write(0xcfc, &value.to_le_bytes());
    }

    /// The device under `addr`, with the bus lock released before the caller uses it (a
    /// config write through ECAM may move a BAR, which needs the bus lock).
    fn mmio_target(
        &self,
        addr: u64,
        len: usize,
    ) -> Option<(u64, tenantvm_devices::bus::SharedBusDevice)> {
        let bus = self.mmio.lock().unwrap();
        bus.resolve(addr, len)
            .map(|(base, dev)| (base, dev.clone()))
    }

    pub fn mmio_write(&self, addr: u64, data: &[u8]) -> bool {
        match self.mmio_target(addr, data.len()) {
            Some((base, dev)) => {
                dev.lock().unwrap().write(base, addr - base, data);
                true
            }
            None => false,
        }
    }

    pub fn mmio_read(&self, addr: u64, data: &mut [u8]) -> bool {
        match self.mmio_target(addr, data.len()) {
            Some((base, dev)) => {
                dev.lock().unwrap().read(base, addr - base, data);
                true
            }
            None => {
                data.fill(0xff);
                false
            }
        }
    }

    /// Writes a config dword through ECAM.
    pub fn ecam_write(&self, slot: u8, offset: u16, value: u32) {
        let addr = ECAM_BASE + (u64::from(slot) << 15) + u64::from(offset);
        self.mmio_write(addr, &value.to_le_bytes());
    }

    pub fn fired(&self) -> Vec<(u16, MsiMessage)> {
        self.sink.fired.lock().unwrap().clone()
    }
}

/// A split virtqueue as a driver lays it out in guest memory.
pub struct GuestQueue {
    pub size: u16,
    pub desc: u64,
    pub avail: u64,
    pub used: u64,
    next_desc: u16,
    avail_idx: u16,
    used_seen: u16,
}

impl GuestQueue {
    pub fn new(base: u64, size: u16) -> Self {
        let desc = base;
        let avail = desc + 16 * u64::from(size);
        let used = (avail + 6 + 2 * u64::from(size)).next_multiple_of(4);
        Self {
            size,
            desc,
            avail,
            used,
            next_desc: 0,
            avail_idx: 0,
            used_seen: 0,
        }
    }

    /// Writes a chain of `(addr, len, device_writable)` buffers and makes it available.
    pub fn add(&mut self, mem: &GuestMemoryMmap, bufs: &[(u64, u32, bool)]) -> u16 {
        let head = self.next_desc;
        for (i, &(addr, len, writable)) in bufs.iter().enumerate() {
            let idx = (head + i as u16) % self.size;
            let next = (idx + 1) % self.size;
            let mut flags = if writable { 2u16 } else { 0 };
            if i + 1 < bufs.len() {
                flags |= 1;
            }
            let at = self.desc + 16 * u64::from(idx);
            mem.write_obj(addr, GuestAddress(at)).unwrap();
            mem.write_obj(len, GuestAddress(at + 8)).unwrap();
            mem.write_obj(flags, GuestAddress(at + 12)).unwrap();
            mem.write_obj(next, GuestAddress(at + 14)).unwrap();
        }
        self.next_desc = (head + bufs.len() as u16) % self.size;
        let slot = self.avail + 4 + 2 * u64::from(self.avail_idx % self.size);
        mem.write_obj(head, GuestAddress(slot)).unwrap();
        self.avail_idx = self.avail_idx.wrapping_add(1);
        mem.write_obj(self.avail_idx, GuestAddress(self.avail + 2))
            .unwrap();
        head
    }

    /// The next used entry, if the device returned one.
    pub fn pop_used(&mut self, mem: &GuestMemoryMmap) -> Option<(u32, u32)> {
        let idx: u16 = mem.read_obj(GuestAddress(self.used + 2)).unwrap();
        if idx == self.used_seen {
            return None;
        }
        let at = self.used + 4 + 8 * u64::from(self.used_seen % self.size);
        self.used_seen = self.used_seen.wrapping_add(1);
        Some((
            mem.read_obj(GuestAddress(at)).unwrap(),
            mem.read_obj(GuestAddress(at + 4)).unwrap(),
        ))
    }
}

/// A virtio-pci driver for one function.
pub struct Driver<'a> {
    pub p: &'a Platform,
    pub slot: u8,
    pub bar: u64,
    common: u64,
    notify: u64,
    notify_mult: u64,
    pub device_cfg: u64,
    msix_cap: u8,
    table: u64,
}

impl<'a> Driver<'a> {
    /// Enumerates the function: sizes and places BAR 0, finds the virtio capabilities,
    /// enables memory decoding, bus mastering and MSI-X (vector v: data 0x30 + v).
    pub fn probe(p: &'a Platform, slot: u8) -> Self {
        assert_eq!(p.cfg_read(slot, 0) & 0xffff, 0x1af4);
        // Size BAR 0 with decoding off, as Linux does, then restore it.
        let lo = p.cfg_read(slot, 0x10);
        let hi = p.cfg_read(slot, 0x14);
        p.cfg_write(slot, 0x10, u32::MAX);
        p.cfg_write(slot, 0x14, u32::MAX);
        let mask =
            u64::from(p.cfg_read(slot, 0x10) & !0xf) | (u64::from(p.cfg_read(slot, 0x14)) << 32);
        assert_eq!(!mask + 1, BAR_SIZE);
        p.cfg_write(slot, 0x10, lo);
        p.cfg_write(slot, 0x14, hi);
        let bar = u64::from(lo & !0xf) | (u64::from(hi) << 32);
        p.cfg_write(slot, 0x04, 0x6);
        let mut d = Driver {
            p,
            slot,
            bar,
            common: 0,
            notify: 0,
            notify_mult: 0,
            device_cfg: 0,
            msix_cap: 0,
            table: 0,
        };
        let mut ptr = (p.cfg_read(slot, 0x34) & 0xff) as u8;
        while ptr != 0 {
            let head = p.cfg_read(slot, ptr);
            match head as u8 {
                0x09 => {
                    let offset = u64::from(p.cfg_read(slot, ptr + 8));
                    match (head >> 24) as u8 {
                        1 => d.common = offset,
                        2 => {
                            d.notify = offset;
                            d.notify_mult = u64::from(p.cfg_read(slot, ptr + 16));
                        }
                        4 => d.device_cfg = offset,
                        _ => {}
                    }
                }
                0x11 => {
                    d.msix_cap = ptr;
                    d.table = u64::from(p.cfg_read(slot, ptr + 4) & !7);
                }
                _ => {}
            }
            ptr = (head >> 8) as u8;
        }
        assert_ne!(d.msix_cap, 0);
        let control = p.cfg_read(slot, d.msix_cap);
        p.cfg_write(slot, d.msix_cap, control | (1 << 31));
        let vectors = ((control >> 16) & 0x7ff) + 1;
        for v in 0..u64::from(vectors) {
            let entry = d.bar + d.table + 16 * v;
            p.mmio_write(entry, &0xfee0_0000u64.to_le_bytes());
            p.mmio_write(entry + 8, &(0x30 + v as u32).to_le_bytes());
            p.mmio_write(entry + 12, &0u32.to_le_bytes());
        }
        d
    }

    pub fn w8(&self, off: u64, v: u8) {
        self.p.mmio_write(self.bar + self.common + off, &[v]);
    }
    pub fn w16(&self, off: u64, v: u16) {
        self.p
            .mmio_write(self.bar + self.common + off, &v.to_le_bytes());
    }
    pub fn w32(&self, off: u64, v: u32) {
        self.p
            .mmio_write(self.bar + self.common + off, &v.to_le_bytes());
    }
    pub fn r8(&self, off: u64) -> u8 {
        let mut d = [0u8];
        self.p.mmio_read(self.bar + self.common + off, &mut d);
        d[0]
    }
    pub fn r32(&self, off: u64) -> u32 {
        let mut d = [0u8; 4];
        self.p.mmio_read(self.bar + self.common + off, &mut d);
        u32::from_le_bytes(d)
    }

    /// Negotiates `wanted` (plus VERSION_1) and returns the accepted features.
    pub fn negotiate(&self, wanted: u64) -> u64 {
        self.w8(0x14, 0);
        self.w8(0x14, 1);
        self.w8(0x14, 3);
        self.w32(0x00, 0);
        let mut offered = u64::from(self.r32(0x04));
        self.w32(0x00, 1);
        offered |= u64::from(self.r32(0x04)) << 32;
        let accepted = offered & (wanted | (1 << 32));
        self.w32(0x08, 0);
        self.w32(0x0c, accepted as u32);
        self.w32(0x08, 1);
        self.w32(0x0c, (accepted >> 32) as u32);
        self.w8(0x14, 0xb);
        assert_eq!(self.r8(0x14) & 0x8, 0x8, "FEATURES_OK refused");
        self.w16(0x10, 0xffff);
        accepted
    }

    /// Configures queue `q` with `queue`'s layout and MSI-X vector `q`.
    pub fn setup_queue(&self, q: u16, queue: &GuestQueue) {
        self.w16(0x16, q);
        self.w16(0x18, queue.size);
        for (off, addr) in [(0x20, queue.desc), (0x28, queue.avail), (0x30, queue.used)] {
            self.w32(off, addr as u32);
            self.w32(off + 4, (addr >> 32) as u32);
        }
        self.w16(0x1a, q);
        self.w16(0x1c, 1);
    }

    pub fn driver_ok(&self) {
        self.w8(0x14, 0xf);
    }

    pub fn status(&self) -> u8 {
        self.r8(0x14)
    }

    pub fn notify(&self, q: u16) {
        self.p.mmio_write(
            self.bar + self.notify + self.notify_mult * u64::from(q),
            &q.to_le_bytes(),
        );
    }

    /// Waits (10 s guard) for a used entry on `queue`.
    pub fn wait_used(&self, queue: &mut GuestQueue) -> (u32, u32) {
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
        loop {
            if let Some(e) = queue.pop_used(&self.p.mem) {
                return e;
            }
            assert!(std::time::Instant::now() < deadline, "no used entry");
            std::thread::sleep(std::time::Duration::from_millis(1));
        }
    }
}

/// Waits (10 s guard) until `cond` holds.
pub fn wait_for(mut cond: impl FnMut() -> bool) {
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
    while !cond() {
        assert!(
            std::time::Instant::now() < deadline,
            "condition not reached"
        );
        std::thread::sleep(std::time::Duration::from_millis(1));
    }
}
