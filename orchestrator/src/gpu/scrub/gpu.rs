//! The hardware scrub: allocate, zero, read back, check, free.

use std::ffi::OsString;
use std::time::Instant;

use rand::Rng;

use super::cuda::{CuDevice, CuDevicePtr, CudaDriver, ATTR_MEMORY_BUS_BITS, ATTR_MEMORY_CLOCK_KHZ};
use super::{ScrubError, ScrubOutcome, VerifyMode, CUDA_LIBRARY};
use crate::receipt::Assurance;

/// Largest allocation chunk.
const MAX_CHUNK: usize = 1 << 30;
/// Smallest chunk worth allocating (the driver's large-page granularity).
const MIN_CHUNK: usize = 2 << 20;
/// Host read-back buffer.
const READBACK_BYTES: usize = 64 << 20;
/// Sampled mode: window size and random windows per chunk.
const SAMPLE_WINDOW: usize = 64 << 10;
const SAMPLES_PER_CHUNK: usize = 16;

/// Which device to scrub.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum DeviceSelector {
    /// A CUDA ordinal among the visible devices.
    Index(i32),
    /// A `GPU-...` or `MIG-...` UUID, as `nvidia-smi -L` prints it.
    Uuid(String),
}

impl DeviceSelector {
    /// An ordinal if `s` is a number, a UUID otherwise.
    pub fn parse(s: &str) -> Self {
        match s.parse::<i32>() {
            Ok(i) => DeviceSelector::Index(i),
            Err(_) => DeviceSelector::Uuid(s.to_string()),
        }
    }
}

impl std::fmt::Display for DeviceSelector {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            DeviceSelector::Index(i) => write!(f, "device {i}"),
            DeviceSelector::Uuid(u) => f.write_str(u),
        }
    }
}

/// How to scrub.
#[derive(Debug, Clone)]
pub struct ScrubOptions {
    /// Read-back mode.
    pub verify: VerifyMode,
    /// Scrub at most this many bytes (tests); `None` for all the device will give.
    pub max_bytes: Option<u64>,
    /// The driver library.
    pub library: OsString,
}

impl Default for ScrubOptions {
    fn default() -> Self {
        ScrubOptions {
            verify: VerifyMode::Full,
            max_bytes: None,
            library: OsString::from(CUDA_LIBRARY),
        }
    }
}

/// Formats a CUuuid as `nvidia-smi` does, without the `GPU-`/`MIG-` prefix.
fn format_uuid(u: &[u8; 16]) -> String {
    uuid::Uuid::from_bytes(*u).hyphenated().to_string()
}

fn strip_prefix(uuid: &str) -> String {
    let lower = uuid.to_ascii_lowercase();
    lower
        .strip_prefix("gpu-")
        .or_else(|| lower.strip_prefix("mig-"))
        .unwrap_or(&lower)
        .to_string()
}

fn find_device(
    driver: &CudaDriver,
    selector: &DeviceSelector,
) -> Result<(CuDevice, String), ScrubError> {
    let count = driver.device_count()?;
    match selector {
        DeviceSelector::Index(i) if (0..count).contains(i) => {
            let dev = driver.device(*i)?;
            Ok((
                dev,
                format!("GPU-{}", format_uuid(&driver.device_uuid(dev)?)),
            ))
        }
        DeviceSelector::Index(_) => Err(ScrubError::NoSuchDevice(selector.to_string())),
        DeviceSelector::Uuid(wanted) => {
            let wanted_hex = strip_prefix(wanted);
            for i in 0..count {
                let dev = driver.device(i)?;
                if format_uuid(&driver.device_uuid(dev)?) == wanted_hex {
                    return Ok((dev, wanted.clone()));
                }
            }
            // A MIG instance named in CUDA_VISIBLE_DEVICES is the only visible device even if
            // an older driver reports its parent's UUID.
            let visible = std::env::var("CUDA_VISIBLE_DEVICES").unwrap_or_default();
            if count == 1 && visible.eq_ignore_ascii_case(wanted) {
                return Ok((driver.device(0)?, wanted.clone()));
            }
            Err(ScrubError::NoSuchDevice(wanted.clone()))
        }
    }
}

/// Device allocations, freed when dropped (also on error paths).
struct Chunks<'a> {
    driver: &'a CudaDriver,
    list: Vec<(CuDevicePtr, usize)>,
}

impl Drop for Chunks<'_> {
    fn drop(&mut self) {
        for (ptr, _) in self.list.drain(..) {
            let _ = self.driver.free(ptr);
        }
    }
}

/// Allocates up to `budget` bytes in chunks, halving the chunk size when the device runs out.
fn allocate(driver: &CudaDriver, budget: usize) -> Result<Chunks<'_>, ScrubError> {
    let mut chunks = Chunks {
        driver,
        list: Vec::new(),
    };
    let mut chunk = MAX_CHUNK.min(budget);
    let mut allocated = 0usize;
    while allocated < budget {
        let want = chunk.min(budget - allocated);
        if want < MIN_CHUNK.min(budget) || want == 0 {
            break;
        }
        match driver.alloc(want)? {
            Some(ptr) => {
                chunks.list.push((ptr, want));
                allocated += want;
            }
            None if chunk > MIN_CHUNK => chunk = (chunk / 2).max(MIN_CHUNK),
            None => break,
        }
    }
    Ok(chunks)
}

/// Counts non-zero bytes in `buf`; returns (count, index of the first).
///
/// Clean 4 KiB blocks are recognised with an OR-fold, which the compiler vectorises (an
/// early-exit `all` would not be, and a full scrub reads back the whole device).
fn count_nonzero(buf: &[u8]) -> (u64, Option<usize>) {
    const BLOCK: usize = 4096;
    let mut count = 0u64;
    let mut first = None;
    for (i, block) in buf.chunks(BLOCK).enumerate() {
        if block.iter().fold(0u8, |acc, &b| acc | b) == 0 {
            continue;
        }
        if first.is_none() {
            first = block.iter().position(|&b| b != 0).map(|p| i * BLOCK + p);
        }
        count += block.iter().filter(|&&b| b != 0).count() as u64;
    }
    (count, first)
}

/// The (offset, length) windows of a chunk of `len` bytes that `mode` reads back.
fn windows(mode: VerifyMode, len: usize, rng: &mut impl Rng) -> Vec<(usize, usize)> {
    match mode {
        VerifyMode::Full => (0..len)
            .step_by(READBACK_BYTES)
            .map(|off| (off, READBACK_BYTES.min(len - off)))
            .collect(),
        VerifyMode::Sampled => {
            let w = SAMPLE_WINDOW.min(len);
            let mut out = vec![(0, w), (len - w, w)];
            for _ in 0..SAMPLES_PER_CHUNK {
                out.push((rng.random_range(0..=len - w), w));
            }
            out
        }
    }
}

/// Zeroes and checks the memory of the selected device. The outcome says whether it passed;
/// an `Err` means the scrub could not run (no driver, no device, a failing driver call).
pub fn scrub_gpu(
    selector: &DeviceSelector,
    opts: &ScrubOptions,
) -> Result<ScrubOutcome, ScrubError> {
    let driver = CudaDriver::load(&opts.library)?;
    let (dev, uuid) = find_device(&driver, selector)?;
    driver.enter(dev)?;
    let result = scrub_current(&driver, dev, &uuid, opts);
    driver.leave(dev);
    result
}

fn scrub_current(
    driver: &CudaDriver,
    dev: CuDevice,
    uuid: &str,
    opts: &ScrubOptions,
) -> Result<ScrubOutcome, ScrubError> {
    let device_name = driver.device_name(dev)?;
    let total_bytes = driver.total_mem(dev)? as u64;
    // After the context exists: what is not free now, the scrub cannot reach.
    let (free, _) = driver.mem_info()?;
    let held_bytes = total_bytes.saturating_sub(free as u64);
    let budget = match opts.max_bytes {
        Some(max) => free.min(usize::try_from(max).unwrap_or(usize::MAX)),
        None => free,
    };
    let peak_gbps = match (
        driver.attribute(ATTR_MEMORY_CLOCK_KHZ, dev),
        driver.attribute(ATTR_MEMORY_BUS_BITS, dev),
    ) {
        (Ok(khz), Ok(bits)) if khz > 0 && bits > 0 => {
            Some(2.0 * f64::from(khz) * 1e3 * f64::from(bits) / 8.0 / 1e9)
        }
        _ => None,
    };

    // Read-back buffer first, so that it does not compete with the scrub for device memory.
    let mut pinned = driver.alloc_host(READBACK_BYTES).ok();
    let mut pageable = Vec::new();
    let buf: &mut [u8] = match pinned.as_mut() {
        Some(p) => p.as_mut_slice(),
        None => {
            pageable.resize(READBACK_BYTES, 0u8);
            &mut pageable
        }
    };

    let chunks = allocate(driver, budget)?;
    if chunks.list.is_empty() {
        return Err(ScrubError::NothingAllocated(uuid.to_string()));
    }
    let scrubbed_bytes: u64 = chunks.list.iter().map(|&(_, len)| len as u64).sum();

    let start = Instant::now();
    for &(ptr, len) in &chunks.list {
        driver.memset(ptr, 0, len)?;
    }
    driver.synchronize()?;
    let zero_seconds = start.elapsed().as_secs_f64();

    let start = Instant::now();
    let mut rng = rand::rng();
    let (mut verified_bytes, mut nonzero_bytes, mut first_nonzero_at) = (0u64, 0u64, None);
    let mut base = 0u64;
    for &(ptr, len) in &chunks.list {
        for (off, n) in windows(opts.verify, len, &mut rng) {
            let window = &mut buf[..n];
            driver.copy_to_host(window, ptr + off as u64)?;
            let (count, first) = count_nonzero(window);
            verified_bytes += n as u64;
            nonzero_bytes += count;
            if first_nonzero_at.is_none() {
                first_nonzero_at = first.map(|i| base + (off + i) as u64);
            }
        }
        base += len as u64;
    }
    let verify_seconds = start.elapsed().as_secs_f64();
    let chunk_count = chunks.list.len() as u64;
    drop(chunks);

    let method = match opts.verify {
        VerifyMode::Full => "cuMemsetD8 zero of all allocatable memory, full read-back",
        VerifyMode::Sampled => "cuMemsetD8 zero of all allocatable memory, sampled read-back",
    };
    let mut outcome = ScrubOutcome {
        device: uuid.to_string(),
        device_name,
        method: method.to_string(),
        assurance: Assurance::Unverified,
        passed: false,
        verify_mode: opts.verify,
        total_bytes,
        held_bytes,
        required_bytes: 0,
        max_bytes: opts.max_bytes,
        slice_bytes: None,
        scrubbed_bytes,
        verified_bytes,
        nonzero_bytes,
        first_nonzero_at,
        chunks: chunk_count,
        zero_seconds,
        verify_seconds,
        zero_gbps: if zero_seconds > 0.0 {
            scrubbed_bytes as f64 / zero_seconds / 1e9
        } else {
            0.0
        },
        peak_gbps,
        driver_version: driver.driver_version()?,
    };
    outcome.judge(None);
    Ok(outcome)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn missing_driver_library_is_a_clear_error() {
        let opts = ScrubOptions {
            library: OsString::from("libcuda-does-not-exist.so.9"),
            ..ScrubOptions::default()
        };
        let err = scrub_gpu(&DeviceSelector::Index(0), &opts).unwrap_err();
        assert!(matches!(err, ScrubError::DriverMissing { .. }), "{err}");
        assert!(err.to_string().contains("install the NVIDIA driver"));
    }

    #[test]
    fn nonzero_bytes_are_counted_and_located() {
        let mut buf = vec![0u8; 4096];
        assert_eq!(count_nonzero(&buf), (0, None));
        buf[100] = 1;
        buf[4000] = 0xff;
        assert_eq!(count_nonzero(&buf), (2, Some(100)));
        let mut big = vec![0u8; 3 * 4096 + 17];
        big[2 * 4096 + 5] = 9;
        big[3 * 4096 + 16] = 1;
        assert_eq!(count_nonzero(&big), (2, Some(2 * 4096 + 5)));
    }

    #[test]
    fn full_windows_cover_every_byte_once() {
        let len = 3 * READBACK_BYTES + 12345;
        let w = windows(VerifyMode::Full, len, &mut rand::rng());
        assert_eq!(w.iter().map(|&(_, n)| n).sum::<usize>(), len);
        for pair in w.windows(2) {
            assert_eq!(pair[0].0 + pair[0].1, pair[1].0);
        }
    }

    #[test]
    fn sampled_windows_stay_inside_the_chunk_and_include_both_ends() {
        let len = 10 * SAMPLE_WINDOW + 7;
        let w = windows(VerifyMode::Sampled, len, &mut rand::rng());
        assert!(w.iter().all(|&(off, n)| off + n <= len));
        assert!(w.contains(&(0, SAMPLE_WINDOW)));
        assert!(w.contains(&(len - SAMPLE_WINDOW, SAMPLE_WINDOW)));
        let tiny = windows(VerifyMode::Sampled, 100, &mut rand::rng());
        assert!(tiny.iter().all(|&(off, n)| off == 0 && n == 100));
    }

    #[test]
    fn uuids_match_with_or_without_prefix() {
        let u = [
            0x12, 0x34, 0x56, 0x78, 0x9a, 0xbc, 0xde, 0xf0, 0x11, 0x22, 0x33, 0x44, 0x55, 0x66,
            0x77, 0x88,
        ];
        assert_eq!(format_uuid(&u), "12345678-9abc-def0-1122-334455667788");
        assert_eq!(
            strip_prefix("MIG-12345678-9ABC-DEF0-1122-334455667788"),
            format_uuid(&u)
        );
        assert_eq!(DeviceSelector::parse("1"), DeviceSelector::Index(1));
        assert!(matches!(
            DeviceSelector::parse("GPU-ab"),
            DeviceSelector::Uuid(_)
        ));
    }

    /// The hardware test: runs only when TENANTVM_TEST_GPU names a GPU (index or UUID).
    #[test]
    fn scrub_zeroes_residue_and_read_back_proves_it() {
        let Ok(target) = std::env::var(super::super::TEST_GPU_ENV) else {
            tenantvm_skip::skip!("set TENANTVM_TEST_GPU=<index or UUID> to run the GPU scrub test");
        };
        let selector = DeviceSelector::parse(&target);
        // Positive control: a buffer filled with a pattern must be seen as non-zero.
        let driver = CudaDriver::load(std::ffi::OsStr::new(CUDA_LIBRARY)).unwrap();
        let (dev, _) = find_device(&driver, &selector).unwrap();
        driver.enter(dev).unwrap();
        let ptr = driver.alloc(MIN_CHUNK).unwrap().unwrap();
        driver.memset(ptr, 0xA5, MIN_CHUNK).unwrap();
        driver.synchronize().unwrap();
        let mut host = vec![0u8; MIN_CHUNK];
        driver.copy_to_host(&mut host, ptr).unwrap();
        assert_eq!(count_nonzero(&host).0, MIN_CHUNK as u64);
        driver.free(ptr).unwrap();
        driver.leave(dev);
        drop(driver);

        for verify in [VerifyMode::Sampled, VerifyMode::Full] {
            let opts = ScrubOptions {
                verify,
                max_bytes: Some(4 << 30),
                ..ScrubOptions::default()
            };
            let out = scrub_gpu(&selector, &opts).unwrap();
            eprintln!("{}", serde_json::to_string(&out).unwrap());
            assert!(out.passed, "{out:?}");
            assert_eq!(out.assurance, Assurance::Verified);
            assert!(out.scrubbed_bytes > 0 && out.verified_bytes > 0);
            if verify == VerifyMode::Full {
                assert_eq!(out.verified_bytes, out.scrubbed_bytes);
            }
        }
    }
}
