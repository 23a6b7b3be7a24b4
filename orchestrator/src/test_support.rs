//! The test-only files of `tests/support/` that the library's own unit tests load too, in
//! one place: the listener as a tenant's uid ([`peercred`]) and the self-signed TLS pair
//! with its trusting client ([`tls_pair`]), a hostile flood of connections ([`flood`]), and
//! the log capture and the file scan of the tests that check a secret never reaches a log
//! or a file ([`captured_log`], [`files_holding`]).

#[path = "../tests/support/flood.rs"]
pub mod flood;
#[path = "../tests/support/peercred.rs"]
pub mod peercred;
#[path = "../tests/support/tls_pair.rs"]
pub mod tls_pair;

use std::io::{Read, Write};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

/// Everything the process logs from the first call on (all threads, every level), for the
/// tests that check a secret or a prompt never reaches the daemon's log. One global
/// subscriber per test binary: every such test shares it.
pub fn captured_log() -> Arc<Mutex<Vec<u8>>> {
    static LOG: std::sync::OnceLock<Arc<Mutex<Vec<u8>>>> = std::sync::OnceLock::new();
    LOG.get_or_init(|| {
        let buf = Arc::new(Mutex::new(Vec::new()));
        let sink = buf.clone();
        let subscriber = tracing_subscriber::fmt()
            .with_max_level(tracing::Level::TRACE)
            .with_ansi(false)
            .with_writer(move || Sink(sink.clone()))
            .finish();
        tracing::subscriber::set_global_default(subscriber).expect("no other global subscriber");
        buf
    })
    .clone()
}

struct Sink(Arc<Mutex<Vec<u8>>>);

impl Write for Sink {
    fn write(&mut self, b: &[u8]) -> std::io::Result<usize> {
        self.0
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .extend_from_slice(b);
        Ok(b.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

/// Files under `dir` (the state directory, store, logs, disk images: everything) holding
/// `needle`, read in pieces so that a large sparse disk image costs no memory.
pub fn files_holding(dir: &Path, needle: &[u8]) -> Vec<PathBuf> {
    let mut found = Vec::new();
    let Ok(entries) = std::fs::read_dir(dir) else {
        return found;
    };
    for e in entries.flatten() {
        let p = e.path();
        if p.is_dir() {
            found.extend(files_holding(&p, needle));
        } else if file_holds(&p, needle) {
            found.push(p);
        }
    }
    found
}

fn file_holds(path: &Path, needle: &[u8]) -> bool {
    use std::io::{Seek, SeekFrom};
    use std::os::fd::AsRawFd;
    let Ok(mut f) = std::fs::File::open(path) else {
        return false;
    };
    let keep = needle.len().saturating_sub(1);
    let mut buf = vec![0u8; (1 << 20) + keep];
    let mut pos: i64 = 0;
    loop {
        // Only the data of a sparse file (a disk image): holes read as zeroes.
        // SAFETY: lseek on an open descriptor has no memory effects.
        let data = unsafe { libc::lseek(f.as_raw_fd(), pos, libc::SEEK_DATA) };
        if data < 0 {
            return false;
        }
        // SAFETY: as above.
        let hole = unsafe { libc::lseek(f.as_raw_fd(), data, libc::SEEK_HOLE) };
        if hole <= data || f.seek(SeekFrom::Start(data as u64)).is_err() {
            return false;
        }
        let mut left = (hole - data) as u64;
        let mut have = 0;
        while left > 0 {
            let want = (buf.len() - have).min(usize::try_from(left).unwrap_or(usize::MAX));
            let n = match f.read(&mut buf[have..have + want]) {
                Ok(0) | Err(_) => return false,
                Ok(n) => n,
            };
            left -= n as u64;
            have += n;
            if buf[..have].windows(needle.len()).any(|w| w == needle) {
                return true;
            }
            // Keep the tail: a needle may straddle two reads.
            let tail = have.saturating_sub(keep);
            buf.copy_within(tail..have, 0);
            have -= tail;
        }
        pos = hole;
    }
}
