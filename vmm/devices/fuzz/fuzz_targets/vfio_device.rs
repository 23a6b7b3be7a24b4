//! What a broken or hostile device hands the VMM: a configuration space (capability
//! lists, BAR probe answers, MSI-X layout, where NVIDIA's GPUDirect clique capability would
//! go) and VFIO region capability chains with sparse mmap areas. Nothing here may panic,
//! loop, or yield an mmap area outside its region or over a trapped page; a placed clique
//! capability never overlaps the device's own capabilities and heads a list that still
//! reaches every one of them.
#![no_main]

use libfuzzer_sys::fuzz_target;
use tenantvm_devices::pci::vfio::{
    mmap_areas, parse_region_caps, probe, walk_caps, walk_ext_caps, GpuDirectCap, IrqIndex,
    IrqInfo, MmapSource, RegionInfo, VfioBackend, VfioBackendError, GPUDIRECT_CAP_OFFSET,
    MAX_CLIQUE, NVIDIA_VENDOR_ID, PAGE_SIZE, REGION_FLAG_MMAP, REGION_FLAG_READ,
};
use tenantvm_vmm_api::ResetOutcome;
use vmm_sys_util::eventfd::EventFd;

/// A device whose configuration space and region sizes are the fuzz input.
struct HostileDevice {
    config: Vec<u8>,
    sizes: [u64; 6],
}

impl VfioBackend for HostileDevice {
    fn region_info(&self, index: u32) -> Option<RegionInfo> {
        let size = match index {
            0..=5 => self.sizes[index as usize],
            7 => self.config.len() as u64,
            _ => return None,
        };
        Some(RegionInfo { size, flags: REGION_FLAG_READ, caps: Vec::new() })
    }
    fn region_read(&self, index: u32, offset: u64, data: &mut [u8]) -> Result<(), VfioBackendError> {
        let err = VfioBackendError::Access { index, offset, len: data.len() };
        let start = usize::try_from(offset).map_err(|_| err)?;
        let end = start.checked_add(data.len()).ok_or(VfioBackendError::NoRegion(index))?;
        let src = self.config.get(start..end).ok_or(VfioBackendError::NoRegion(index))?;
        data.copy_from_slice(src);
        Ok(())
    }
    fn region_write(&self, _: u32, _: u64, _: &[u8]) -> Result<(), VfioBackendError> {
        // The device ignores writes: BAR probes read back whatever it had.
        Ok(())
    }
    fn region_mmap(&self, _: u32) -> Option<MmapSource<'_>> {
        None
    }
    fn irq_info(&self, _: IrqIndex) -> Option<IrqInfo> {
        Some(IrqInfo { count: 8, flags: 0 })
    }
    fn irq_enable(&self, _: IrqIndex, _: &[&EventFd]) -> Result<(), VfioBackendError> {
        Ok(())
    }
    fn irq_disable(&self, _: IrqIndex) -> Result<(), VfioBackendError> {
        Ok(())
    }
    fn irq_unmask(&self, _: IrqIndex) -> Result<(), VfioBackendError> {
        Ok(())
    }
    fn irq_unmask_on(&self, _: IrqIndex, _: &EventFd) -> Result<(), VfioBackendError> {
        Ok(())
    }
    fn reset(&self) -> ResetOutcome {
        ResetOutcome::Unsupported
    }
}

fuzz_target!(|data: &[u8]| {
    let (config, rest) = data.split_at(data.len().min(4096));
    let mut config = config.to_vec();
    config.resize(if data.len() > 256 { 4096 } else { 256 }, 0);

    let caps = walk_caps(&config);
    assert!(caps.len() <= 48);
    assert!(caps.iter().all(|c| (0x40..0x100).contains(&c.offset)));
    let ext = walk_ext_caps(&config);
    let mut seen = std::collections::HashSet::new();
    assert!(ext.iter().all(|c| c.offset >= 0x100 && c.offset < 4096 && seen.insert(c.offset)));

    gpudirect(&config, data.last().copied().unwrap_or(0));

    let mut sizes = [0u64; 6];
    for (i, s) in sizes.iter_mut().enumerate() {
        *s = rest.get(i * 8..i * 8 + 8).map_or(0, |b| u64::from_le_bytes(b.try_into().unwrap()));
    }
    let _ = probe(&HostileDevice { config: config.clone(), sizes });

    // Region capabilities: the rest of the input after the sizes.
    let rest = rest.get(48..).unwrap_or(&[]);
    if rest.len() < 12 {
        return;
    }
    let first = u32::from_le_bytes(rest[0..4].try_into().unwrap()) % 512;
    let size = u64::from_le_bytes(rest[4..12].try_into().unwrap());
    let Ok(region_caps) = parse_region_caps(&rest[12..], first) else {
        return;
    };
    let info = RegionInfo { size, flags: REGION_FLAG_READ | REGION_FLAG_MMAP, caps: region_caps };
    let trapped = [(size / 3, 16u64), (size / 2 + 8, 8u64)];
    if let Ok(areas) = mmap_areas(&info, &trapped) {
        for a in &areas {
            assert!(a.offset % PAGE_SIZE == 0 && a.size % PAGE_SIZE == 0 && a.size > 0);
            assert!(a.offset.checked_add(a.size).is_some_and(|e| e <= size));
            for &(t, len) in &trapped {
                let page = t & !(PAGE_SIZE - 1);
                let end = (t + len).next_multiple_of(PAGE_SIZE);
                assert!(a.offset + a.size <= page || a.offset >= end);
            }
        }
    }
});

/// The GPUDirect clique capability placed at 0xD4 of the hostile configuration space. With
/// bit 7 of `knob` the space is made an NVIDIA display controller (so the fuzzer reaches
/// the overlap checks); bits 0-4 are the clique id (16-31 out of range).
fn gpudirect(config: &[u8], knob: u8) {
    let mut cfg = config.to_vec();
    if knob & 0x80 != 0 {
        cfg[0..2].copy_from_slice(&NVIDIA_VENDOR_ID.to_le_bytes());
        cfg[0x0b] = 0x03;
    }
    let clique = knob & 0x1f;
    let Ok(cap) = GpuDirectCap::place(&cfg, clique) else {
        return;
    };
    assert!(clique <= MAX_CLIQUE);
    assert_eq!(u16::from_le_bytes([cfg[0], cfg[1]]), NVIDIA_VENDOR_ID);
    assert_eq!(cfg[0x0b], 0x03);
    let own = walk_caps(&cfg);
    let ours = GPUDIRECT_CAP_OFFSET..GPUDIRECT_CAP_OFFSET + 8;
    assert!(own.iter().all(|c| !ours.contains(&c.offset)), "{own:?}");
    let bytes = cap.bytes();
    assert_eq!(
        &bytes[..6],
        &[
            0x09,
            own.first().map_or(0, |c| c.offset as u8),
            8,
            b'P',
            b'2',
            b'P'
        ]
    );
    assert_eq!(bytes[6], clique << 3);
    // The guest's view: the list head at 0xD4, the capability there, pointing on to the
    // device's own list, which it must still walk in full (up to the walk's own cap).
    let mut seen = cfg.clone();
    seen[0x06] |= 0x10;
    seen[0x34] = GPUDIRECT_CAP_OFFSET as u8;
    seen[ours.clone()].copy_from_slice(&bytes);
    let walked: Vec<usize> = walk_caps(&seen).iter().map(|c| c.offset).collect();
    assert_eq!(walked.first(), Some(&GPUDIRECT_CAP_OFFSET));
    let rest: Vec<usize> = own
        .iter()
        .map(|c| c.offset)
        .take(walked.len() - 1)
        .collect();
    assert_eq!(&walked[1..], &rest[..], "own {own:?}");
    for reg in 0..64 {
        let inside = ours.contains(&(reg * 4));
        assert_eq!(cap.read_reg(reg).is_some(), inside, "reg {reg}");
    }
}
