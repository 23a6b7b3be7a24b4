//! The vfio-kernel scenario's program: vfio-ioctls against the real kernel's vfio-pci, with
//! QEMU's `edu` device (1234:11e8) and `nvme` device (1b36:0010) bound to vfio-pci by the
//! scenario script. Run as root inside the nested host's outer guest.
//!
//! ```text
//! nh-vfio-kernel --edu BDF --nvme BDF
//! ```
//!
//! On edu: opens the container, the group and the device; region info (BAR0 1 MiB and
//! mmap-able, the config region); config space (vendor/device IDs); BAR0 mmapped: the ID
//! register (0x010000ED), the liveness register, the factorial unit; an eventfd wired to the
//! MSI with VFIO_DEVICE_SET_IRQS fires after a write to the interrupt raise register (0x60)
//! and not before; a DMA-mapped buffer: edu's DMA engine copies a pattern from one mapped
//! buffer into its own memory and back into another, and after that buffer is unmapped the
//! engine's write does not reach it (the IOMMU blocks it). Reset: edu has no reset method,
//! so VFIO_DEVICE_RESET must fail and is reported as the failure it is; nvme resets by FLR,
//! VFIO_DEVICE_RESET succeeds, and the controller configuration written before reads 0 after.
//! vfio-ioctls' own `reset()` ignores the ioctl's result, so the ioctl is issued here.
//!
//! Prints one `ok:` line per check; exits 1 with `nh-vfio-kernel: FAILED: ...` otherwise.

use std::os::fd::{AsRawFd, RawFd};
use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::Arc;
use std::time::{Duration, Instant};

use vfio_bindings::bindings::vfio::{
    vfio_device_info, VFIO_DEVICE_FLAGS_PCI, VFIO_DEVICE_FLAGS_RESET, VFIO_PCI_BAR0_REGION_INDEX,
    VFIO_PCI_CONFIG_REGION_INDEX, VFIO_PCI_MSI_IRQ_INDEX, VFIO_REGION_INFO_FLAG_MMAP,
    VFIO_REGION_INFO_FLAG_READ, VFIO_REGION_INFO_FLAG_WRITE,
};
use vfio_ioctls::{VfioContainer, VfioDevice};
use vmm_sys_util::eventfd::{EventFd, EFD_NONBLOCK};
use vmm_sys_util::ioctl::{ioctl_with_mut_ref, ioctl_with_val};
use vmm_sys_util::ioctl_io_nr;

// The VFIO ioctls this program issues itself (linux/vfio.h: _IO(';', 100 + n)).
ioctl_io_nr!(VFIO_DEVICE_GET_INFO, 0x3b, 100 + 7);
ioctl_io_nr!(VFIO_DEVICE_RESET, 0x3b, 100 + 11);

/// edu's registers (QEMU docs/specs/edu.rst), offsets into BAR0.
mod edu {
    pub const ID: usize = 0x00;
    pub const LIVENESS: usize = 0x04;
    pub const FACTORIAL: usize = 0x08;
    pub const STATUS: usize = 0x20;
    pub const IRQ_STATUS: usize = 0x24;
    pub const IRQ_RAISE: usize = 0x60;
    pub const IRQ_ACK: usize = 0x64;
    pub const DMA_SRC: usize = 0x80;
    pub const DMA_DST: usize = 0x88;
    pub const DMA_COUNT: usize = 0x90;
    pub const DMA_CMD: usize = 0x98;
    /// DMA command bits: run; direction edu -> RAM (else RAM -> edu).
    pub const DMA_RUN: u64 = 0x1;
    pub const DMA_TO_RAM: u64 = 0x2;
    /// The device address of edu's 4 KiB DMA buffer.
    pub const BUFFER: u64 = 0x40000;
    /// The ID register: version 1.0, 0xED.
    pub const ID_VALUE: u32 = 0x0100_00ed;
}

/// NVMe's controller configuration register (BAR0 0x14): read-write, 0 after a function
/// reset. The value written sets the I/O queue entry sizes and leaves the controller
/// disabled (EN = 0).
const NVME_CC: u64 = 0x14;
const NVME_CC_QUEUE_SIZES: u32 = 0x0046_0000;
/// PCI command register bits: memory space, bus master.
const PCI_COMMAND: u64 = 0x04;
const PCI_COMMAND_MEMORY_MASTER: u16 = 0x6;

type Check<T = ()> = Result<T, String>;

fn ok(msg: impl std::fmt::Display) {
    println!("ok: {msg}");
}

fn ensure(cond: bool, msg: impl FnOnce() -> String) -> Check {
    if cond {
        Ok(())
    } else {
        Err(msg())
    }
}

/// Checked reads and writes of a region through the device fd (vfio-ioctls' region_read
/// and region_write only log their errors).
fn pread(fd: RawFd, buf: &mut [u8], offset: u64) -> Check {
    // SAFETY: buf is valid for buf.len() bytes of writes; fd is the open device.
    let n = unsafe {
        libc::pread(
            fd,
            buf.as_mut_ptr().cast(),
            buf.len(),
            offset as libc::off_t,
        )
    };
    ensure(n == buf.len() as isize, || {
        format!(
            "pread of {} bytes at {offset:#x}: {}",
            buf.len(),
            std::io::Error::last_os_error()
        )
    })
}

fn pwrite(fd: RawFd, buf: &[u8], offset: u64) -> Check {
    // SAFETY: buf is valid for buf.len() bytes of reads; fd is the open device.
    let n = unsafe { libc::pwrite(fd, buf.as_ptr().cast(), buf.len(), offset as libc::off_t) };
    ensure(n == buf.len() as isize, || {
        format!(
            "pwrite of {} bytes at {offset:#x}: {}",
            buf.len(),
            std::io::Error::last_os_error()
        )
    })
}

/// One opened vfio-pci device.
struct Device {
    name: String,
    dev: VfioDevice,
}

impl Device {
    fn open(container: &Arc<VfioContainer>, bdf: &str) -> Check<Self> {
        let sysfs = PathBuf::from("/sys/bus/pci/devices").join(bdf);
        let group = std::fs::read_link(sysfs.join("iommu_group"))
            .map_err(|e| format!("{bdf} has no IOMMU group: {e}"))?;
        let dev = VfioDevice::new(&sysfs, container.clone(), false).map_err(|e| {
            format!(
                "opening {bdf} through vfio (group {}): {e}",
                group.display()
            )
        })?;
        ok(format!(
            "{bdf}: container, group /dev/vfio/{} and device opened",
            group.file_name().unwrap_or_default().to_string_lossy()
        ));
        Ok(Device {
            name: bdf.to_string(),
            dev,
        })
    }

    fn fd(&self) -> RawFd {
        self.dev.as_raw_fd()
    }

    fn info(&self) -> Check<vfio_device_info> {
        let mut info = vfio_device_info {
            argsz: std::mem::size_of::<vfio_device_info>() as u32,
            ..Default::default()
        };
        // SAFETY: VFIO_DEVICE_GET_INFO fills a vfio_device_info of the argsz given.
        let rc = unsafe { ioctl_with_mut_ref(&self.dev, VFIO_DEVICE_GET_INFO(), &mut info) };
        ensure(rc == 0, || {
            format!(
                "{}: VFIO_DEVICE_GET_INFO: {}",
                self.name,
                std::io::Error::last_os_error()
            )
        })?;
        Ok(info)
    }

    /// VFIO_DEVICE_RESET, with its result.
    fn reset(&self) -> std::io::Result<()> {
        // SAFETY: VFIO_DEVICE_RESET takes no argument.
        let rc = unsafe { ioctl_with_val(&self.dev, VFIO_DEVICE_RESET(), 0) };
        if rc == 0 {
            Ok(())
        } else {
            Err(std::io::Error::last_os_error())
        }
    }

    fn config_offset(&self) -> u64 {
        self.dev.get_region_offset(VFIO_PCI_CONFIG_REGION_INDEX)
    }

    fn config_read_u32(&self, reg: u64) -> Check<u32> {
        let mut b = [0u8; 4];
        pread(self.fd(), &mut b, self.config_offset() + reg)?;
        Ok(u32::from_le_bytes(b))
    }

    /// Turns on memory decoding and bus mastering (DMA and MSI need the latter).
    fn enable_memory_and_dma(&self) -> Check {
        let mut b = [0u8; 2];
        pread(self.fd(), &mut b, self.config_offset() + PCI_COMMAND)?;
        let cmd = u16::from_le_bytes(b) | PCI_COMMAND_MEMORY_MASTER;
        pwrite(
            self.fd(),
            &cmd.to_le_bytes(),
            self.config_offset() + PCI_COMMAND,
        )
    }

    fn bar0_read_u32(&self, reg: u64) -> Check<u32> {
        let mut b = [0u8; 4];
        pread(
            self.fd(),
            &mut b,
            self.dev.get_region_offset(VFIO_PCI_BAR0_REGION_INDEX) + reg,
        )?;
        Ok(u32::from_le_bytes(b))
    }

    fn bar0_write_u32(&self, reg: u64, v: u32) -> Check {
        pwrite(
            self.fd(),
            &v.to_le_bytes(),
            self.dev.get_region_offset(VFIO_PCI_BAR0_REGION_INDEX) + reg,
        )
    }
}

/// A mapping of BAR0 into this process.
struct Bar {
    base: *mut u8,
    len: usize,
}

impl Bar {
    fn map(d: &Device) -> Check<Bar> {
        let len = d.dev.get_region_size(VFIO_PCI_BAR0_REGION_INDEX) as usize;
        let offset = d.dev.get_region_offset(VFIO_PCI_BAR0_REGION_INDEX);
        // SAFETY: a new shared mapping of the device fd at the region's offset; the kernel
        // checks the range. The result is checked before use.
        let base = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED,
                d.fd(),
                offset as libc::off_t,
            )
        };
        ensure(base != libc::MAP_FAILED, || {
            format!("mmap of BAR0: {}", std::io::Error::last_os_error())
        })?;
        Ok(Bar {
            base: base.cast(),
            len,
        })
    }

    fn read32(&self, reg: usize) -> u32 {
        assert!(reg + 4 <= self.len);
        // SAFETY: reg is inside the mapping (asserted) and 4-byte aligned by the callers'
        // constants; device registers are read with a volatile access.
        unsafe { std::ptr::read_volatile(self.base.add(reg).cast::<u32>()) }
    }

    fn write32(&self, reg: usize, v: u32) {
        assert!(reg + 4 <= self.len);
        // SAFETY: as in read32.
        unsafe { std::ptr::write_volatile(self.base.add(reg).cast::<u32>(), v) }
    }

    fn read64(&self, reg: usize) -> u64 {
        assert!(reg + 8 <= self.len);
        // SAFETY: as in read32; edu's DMA registers take 8-byte accesses.
        unsafe { std::ptr::read_volatile(self.base.add(reg).cast::<u64>()) }
    }

    fn write64(&self, reg: usize, v: u64) {
        assert!(reg + 8 <= self.len);
        // SAFETY: as in read64.
        unsafe { std::ptr::write_volatile(self.base.add(reg).cast::<u64>(), v) }
    }
}

impl Drop for Bar {
    fn drop(&mut self) {
        // SAFETY: the mapping made in Bar::map, unmapped once.
        unsafe { libc::munmap(self.base.cast(), self.len) };
    }
}

/// A page of anonymous memory that a device may DMA into: touched only through raw
/// pointers with volatile accesses.
struct DmaPage {
    base: *mut u8,
}

const PAGE: usize = 4096;
/// Bytes per DMA transfer: half a page (QEMU 7.2's edu refuses, by aborting QEMU, a
/// transfer that ends exactly at the end of its 4 KiB buffer).
const DMA_LEN: usize = 2048;

impl DmaPage {
    fn new() -> Check<DmaPage> {
        // SAFETY: a new private anonymous mapping; the result is checked before use.
        let base = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                PAGE,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_POPULATE,
                -1,
                0,
            )
        };
        ensure(base != libc::MAP_FAILED, || {
            format!("mmap: {}", std::io::Error::last_os_error())
        })?;
        Ok(DmaPage { base: base.cast() })
    }

    fn fill(&self, f: impl Fn(usize) -> u8) {
        for i in 0..PAGE {
            // SAFETY: i < PAGE, inside the mapping.
            unsafe { std::ptr::write_volatile(self.base.add(i), f(i)) }
        }
    }

    fn matches(&self, f: impl Fn(usize) -> u8) -> Option<usize> {
        (0..PAGE).find(|&i| {
            // SAFETY: i < PAGE, inside the mapping.
            unsafe { std::ptr::read_volatile(self.base.add(i)) != f(i) }
        })
    }
}

impl Drop for DmaPage {
    fn drop(&mut self) {
        // SAFETY: the mapping made in DmaPage::new, unmapped once (after its DMA unmap).
        unsafe { libc::munmap(self.base.cast(), PAGE) };
    }
}

fn wait_until(what: &str, timeout: Duration, mut done: impl FnMut() -> bool) -> Check {
    let deadline = Instant::now() + timeout;
    while !done() {
        if Instant::now() > deadline {
            return Err(format!("{what} did not happen within {timeout:?}"));
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    Ok(())
}

/// Whether the eventfd fires within `timeout` (and consumes its count).
fn fired(evt: &EventFd, timeout: Duration) -> Check<Option<u64>> {
    let mut pfd = libc::pollfd {
        fd: evt.as_raw_fd(),
        events: libc::POLLIN,
        revents: 0,
    };
    // SAFETY: one valid pollfd.
    let n = unsafe { libc::poll(&mut pfd, 1, timeout.as_millis() as libc::c_int) };
    ensure(n >= 0, || {
        format!("poll: {}", std::io::Error::last_os_error())
    })?;
    if n == 0 {
        return Ok(None);
    }
    evt.read()
        .map(Some)
        .map_err(|e| format!("eventfd read: {e}"))
}

/// Runs edu's DMA engine: `count` bytes from `src` to `dst`, `to_ram` giving the direction.
fn edu_dma(bar: &Bar, src: u64, dst: u64, count: u64, to_ram: bool) -> Check {
    bar.write64(edu::DMA_SRC, src);
    bar.write64(edu::DMA_DST, dst);
    bar.write64(edu::DMA_COUNT, count);
    let dir = if to_ram { edu::DMA_TO_RAM } else { 0 };
    bar.write64(edu::DMA_CMD, edu::DMA_RUN | dir);
    wait_until("edu's DMA completion", Duration::from_secs(20), || {
        bar.read64(edu::DMA_CMD) & edu::DMA_RUN == 0
    })
}

fn check_edu(container: &Arc<VfioContainer>, bdf: &str) -> Check {
    let d = Device::open(container, bdf)?;
    let info = d.info()?;
    ensure(info.flags & VFIO_DEVICE_FLAGS_PCI != 0, || {
        format!("{bdf} is not a vfio PCI device")
    })?;
    ok(format!(
        "{bdf}: {} regions, {} IRQ types, flags {:#x}",
        info.num_regions, info.num_irqs, info.flags
    ));

    // Region info.
    let flags = d.dev.get_region_flags(VFIO_PCI_BAR0_REGION_INDEX);
    let size = d.dev.get_region_size(VFIO_PCI_BAR0_REGION_INDEX);
    let want =
        VFIO_REGION_INFO_FLAG_READ | VFIO_REGION_INFO_FLAG_WRITE | VFIO_REGION_INFO_FLAG_MMAP;
    ensure(size == 1 << 20 && flags & want == want, || {
        format!("edu BAR0 region: size {size:#x}, flags {flags:#x} (want 1 MiB, read/write/mmap)")
    })?;
    let cfg_size = d.dev.get_region_size(VFIO_PCI_CONFIG_REGION_INDEX);
    ensure(cfg_size >= 256, || {
        format!("config region of {cfg_size} bytes")
    })?;
    ok(format!(
        "region info: BAR0 1 MiB read/write/mmap, config space {cfg_size} bytes"
    ));

    // Config space.
    let ids = d.config_read_u32(0)?;
    ensure(ids == 0x11e8_1234, || {
        format!("config space vendor/device {ids:#010x}, want 0x11e81234")
    })?;
    ok("config space: vendor 1234, device 11e8");
    d.enable_memory_and_dma()?;

    // BAR0 mmapped.
    let bar = Bar::map(&d)?;
    let id = bar.read32(edu::ID);
    ensure(id == edu::ID_VALUE, || {
        format!("edu ID register {id:#010x}, want {:#010x}", edu::ID_VALUE)
    })?;
    ok(format!("BAR0 mmapped: ID register {id:#010x}"));
    bar.write32(edu::LIVENESS, 0x1234_5678);
    let live = bar.read32(edu::LIVENESS);
    ensure(live == !0x1234_5678u32, || {
        format!("liveness register read {live:#x}, want the inverse")
    })?;
    bar.write32(edu::FACTORIAL, 5);
    wait_until("the factorial", Duration::from_secs(10), || {
        bar.read32(edu::STATUS) & 1 == 0
    })?;
    let fact = bar.read32(edu::FACTORIAL);
    ensure(fact == 120, || format!("factorial(5) = {fact}"))?;
    ok("liveness register inverted, factorial(5) = 120");

    // MSI through an eventfd.
    let msi = d
        .dev
        .get_irq_info(VFIO_PCI_MSI_IRQ_INDEX)
        .ok_or("edu offers no MSI through vfio")?;
    ensure(msi.count >= 1, || "edu's MSI has no vectors".into())?;
    let evt = EventFd::new(EFD_NONBLOCK).map_err(|e| format!("eventfd: {e}"))?;
    d.dev
        .enable_msi(vec![&evt])
        .map_err(|e| format!("VFIO_DEVICE_SET_IRQS (MSI, eventfd): {e}"))?;
    if let Some(n) = fired(&evt, Duration::from_millis(500))? {
        return Err(format!(
            "the MSI eventfd fired {n} times before any interrupt was raised"
        ));
    }
    bar.write32(edu::IRQ_RAISE, 0x5a);
    let got = fired(&evt, Duration::from_secs(10))?.ok_or("no MSI within 10 s of the raise")?;
    let status = bar.read32(edu::IRQ_STATUS);
    ensure(status & 0x5a == 0x5a, || {
        format!("interrupt status {status:#x}")
    })?;
    bar.write32(edu::IRQ_ACK, status);
    ok(format!(
        "MSI eventfd fired ({got}) after a write of 0x5a to the raise register"
    ));

    // DMA through the IOMMU: RAM page A -> edu's buffer -> RAM page B.
    let (a, b) = (DmaPage::new()?, DmaPage::new()?);
    let (iova_a, iova_b) = (0x10_0000u64, 0x20_0000u64);
    let pattern = |i: usize| (i * 7 + 3) as u8;
    a.fill(pattern);
    b.fill(|_| 0);
    // SAFETY: both pages are ours, touched only with volatile accesses while mapped, and
    // unmapped from the IOMMU before they are freed (below, before the drops).
    unsafe {
        container
            .vfio_dma_map(iova_a, PAGE, a.base)
            .map_err(|e| format!("VFIO_IOMMU_MAP_DMA of page A: {e}"))?;
        container
            .vfio_dma_map(iova_b, PAGE, b.base)
            .map_err(|e| format!("VFIO_IOMMU_MAP_DMA of page B: {e}"))?;
    }
    // What page B must hold after the copy: the pattern where the DMA wrote, zero beyond.
    let copied = |i: usize| if i < DMA_LEN { pattern(i) } else { 0 };
    edu_dma(&bar, iova_a, edu::BUFFER, DMA_LEN as u64, false)?;
    edu_dma(&bar, edu::BUFFER, iova_b, DMA_LEN as u64, true)?;
    if let Some(i) = b.matches(copied) {
        return Err(format!(
            "after edu's DMA, page B differs from what was copied at byte {i}"
        ));
    }
    ok(format!("DMA: edu copied {DMA_LEN} bytes from mapped IOVA 0x100000 into its buffer and out to IOVA 0x200000, and no more"));
    // Unmapped, page B is out of the device's reach.
    container
        .vfio_dma_unmap(iova_b, PAGE)
        .map_err(|e| format!("VFIO_IOMMU_UNMAP_DMA of page B: {e}"))?;
    a.fill(|i| !pattern(i));
    edu_dma(&bar, iova_a, edu::BUFFER, DMA_LEN as u64, false)?;
    edu_dma(&bar, edu::BUFFER, iova_b, DMA_LEN as u64, true)?;
    if let Some(i) = b.matches(copied) {
        return Err(format!(
            "edu's DMA reached page B after it was unmapped (byte {i} changed)"
        ));
    }
    ok("DMA: after the unmap, the IOMMU kept edu's write out of page B");
    container
        .vfio_dma_unmap(iova_a, PAGE)
        .map_err(|e| format!("VFIO_IOMMU_UNMAP_DMA of page A: {e}"))?;
    d.dev
        .disable_msi()
        .map_err(|e| format!("disabling MSI: {e}"))?;

    // Reset: edu has no reset method; the ioctl must say so.
    ensure(info.flags & VFIO_DEVICE_FLAGS_RESET == 0, || {
        "vfio claims edu can be reset (VFIO_DEVICE_FLAGS_RESET), but edu has no reset method".into()
    })?;
    match d.reset() {
        Ok(()) => {
            Err("VFIO_DEVICE_RESET on edu reported success, but edu has no reset method".into())
        }
        Err(e) => {
            ok(format!(
                "reset of edu refused as it must be: no reset method (VFIO_DEVICE_RESET: {e})"
            ));
            Ok(())
        }
    }
}

fn check_nvme(container: &Arc<VfioContainer>, bdf: &str) -> Check {
    let d = Device::open(container, bdf)?;
    let ids = d.config_read_u32(0)?;
    ensure(ids == 0x0010_1b36, || {
        format!("nvme vendor/device {ids:#010x}, want 0x00101b36")
    })?;
    let info = d.info()?;
    ensure(info.flags & VFIO_DEVICE_FLAGS_RESET != 0, || {
        format!(
            "vfio does not offer a reset for {bdf} (flags {:#x}); QEMU's nvme has FLR",
            info.flags
        )
    })?;
    let method = std::fs::read_to_string(format!("/sys/bus/pci/devices/{bdf}/reset_method"))
        .unwrap_or_default();
    d.enable_memory_and_dma()?;
    d.bar0_write_u32(NVME_CC, NVME_CC_QUEUE_SIZES)?;
    let before = d.bar0_read_u32(NVME_CC)?;
    ensure(before == NVME_CC_QUEUE_SIZES, || {
        format!("nvme CC read {before:#x} after writing {NVME_CC_QUEUE_SIZES:#x}")
    })?;
    d.reset()
        .map_err(|e| format!("VFIO_DEVICE_RESET on nvme ({}) failed: {e}", method.trim()))?;
    d.enable_memory_and_dma()?;
    let after = d.bar0_read_u32(NVME_CC)?;
    ensure(after == 0, || {
        format!("nvme CC still {after:#x} after the reset")
    })?;
    ok(format!(
        "reset of nvme ({}) succeeded: the controller configuration is back to 0",
        method.trim()
    ));
    Ok(())
}

fn run(edu: &str, nvme: &str) -> Check {
    let container =
        Arc::new(VfioContainer::new(None).map_err(|e| format!("opening /dev/vfio/vfio: {e}"))?);
    ok("container /dev/vfio/vfio: API version and type1v2 IOMMU");
    check_edu(&container, edu)?;
    check_nvme(&container, nvme)
}

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let value = |flag: &str| {
        args.iter()
            .position(|a| a == flag)
            .and_then(|i| args.get(i + 1))
    };
    let (Some(edu), Some(nvme)) = (value("--edu"), value("--nvme")) else {
        eprintln!("usage: nh-vfio-kernel --edu BDF --nvme BDF   (both bound to vfio-pci)");
        return ExitCode::from(2);
    };
    match run(edu, nvme) {
        Ok(()) => {
            println!("nh-vfio-kernel: all checks passed");
            ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("nh-vfio-kernel: FAILED: {e}");
            ExitCode::FAILURE
        }
    }
}
