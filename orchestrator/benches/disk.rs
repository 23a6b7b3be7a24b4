//! Disk benchmark: LUKS2 image creation with the production and the test keyslot cost, the
//! key check a guest pays at open, and the crypto-shred of a 10 GiB sparse image (empty, and
//! with 1 GiB of data written). Run with `scripts/bench-disk.sh` or
//! `cargo bench -p tenantvm --bench disk`. Set TENANTVM_BENCH_DIR to benchmark another
//! filesystem than the temporary directory's.

use std::fs::OpenOptions;
use std::io::{Seek, SeekFrom, Write};
use std::path::Path;
use std::time::{Duration, Instant};

use tenantvm::disk::{create_image, key_opens, shred_image, KeyslotCost, HEADER_BYTES};
use tenantvm::keys::DiskKey;

const GIB: u64 = 1 << 30;

fn stats(name: &str, samples: &mut [Duration]) {
    samples.sort();
    let ms = |d: Duration| d.as_secs_f64() * 1e3;
    println!(
        "{name:<52} median {:>9.1} ms   min {:>9.1} ms   max {:>9.1} ms   (n={})",
        ms(samples[samples.len() / 2]),
        ms(samples[0]),
        ms(samples[samples.len() - 1]),
        samples.len()
    );
}

fn time<T>(f: impl FnOnce() -> T) -> (Duration, T) {
    let start = Instant::now();
    let out = f();
    (start.elapsed(), out)
}

/// Writes `bytes` of incompressible data into the data area, spread over the image.
fn write_data(path: &Path, size: u64, bytes: u64) {
    let mut file = OpenOptions::new().write(true).open(path).unwrap();
    let block = vec![0x5Au8; 4 << 20];
    let blocks = bytes / block.len() as u64;
    let stride = (size - HEADER_BYTES) / blocks;
    for i in 0..blocks {
        file.seek(SeekFrom::Start(HEADER_BYTES + i * stride))
            .unwrap();
        file.write_all(&block).unwrap();
    }
    file.sync_all().unwrap();
}

fn main() {
    let base = std::env::var_os("TENANTVM_BENCH_DIR")
        .map_or_else(std::env::temp_dir, std::path::PathBuf::from);
    let dir = tempfile::tempdir_in(&base).expect("a writable benchmark directory");
    let image = dir.path().join("bench.img");
    println!("disk benchmark in {}", dir.path().display());

    for (label, cost, n) in [
        (
            "create 1 GiB image, test keyslot cost",
            KeyslotCost::TEST,
            5,
        ),
        (
            "create 1 GiB image, production keyslot cost",
            KeyslotCost::PRODUCTION,
            3,
        ),
    ] {
        let mut samples = Vec::new();
        for _ in 0..n {
            let key = DiskKey::random().unwrap();
            let (t, r) = time(|| create_image(&image, GIB, &key, cost));
            r.unwrap();
            samples.push(t);
            shred_image(&image, None).unwrap();
        }
        stats(label, &mut samples);
    }

    let key = DiskKey::random().unwrap();
    create_image(&image, GIB, &key, KeyslotCost::PRODUCTION).unwrap();
    let mut samples = Vec::new();
    for _ in 0..3 {
        let (t, opens) = time(|| key_opens(&image, &key).unwrap());
        assert!(opens);
        samples.push(t);
    }
    stats(
        "key check (what a guest open pays), production",
        &mut samples,
    );
    shred_image(&image, None).unwrap();

    for (label, written) in [
        ("crypto-shred 10 GiB sparse image, empty", 0),
        ("crypto-shred 10 GiB sparse image, 1 GiB written", GIB),
    ] {
        let mut samples = Vec::new();
        for _ in 0..3 {
            let key = DiskKey::random().unwrap();
            create_image(&image, 10 * GIB, &key, KeyslotCost::TEST).unwrap();
            if written > 0 {
                write_data(&image, 10 * GIB, written);
            }
            let (t, report) = time(|| shred_image(&image, Some(&key)).unwrap());
            assert!(report.deleted && report.old_key_rejected == Some(true));
            samples.push(t);
        }
        stats(label, &mut samples);
    }
}
