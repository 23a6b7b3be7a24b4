//! The plaintext scan of checks 7 and 9: which host files hold a marker, read in chunks,
//! never following links, leaving real tenants' disk images alone.

use std::io::Read;
use std::path::Path;

use super::host::{io_err, HostError};

/// Largest file the plaintext scan reads (sparse disk images of probes are far smaller).
const SCAN_MAX_FILE: u64 = 8 << 30;

/// Real tenants' disk images are not read by the marker scan: the marker goes to probes
/// only, a real disk can be hundreds of GiB, and what is on it is that tenant's (encrypted)
/// data, which the verifier does not touch.
pub(super) fn skip_real_disks(path: &Path) -> bool {
    path.file_name()
        .is_some_and(|n| n == crate::tenant::steps::disk::IMAGE_FILE)
        && path
            .parent()
            .and_then(Path::file_name)
            .and_then(|n| n.to_str())
            .is_some_and(|t| !super::probe::looks_like_probe(t))
}

/// Appends to `found` every regular file under `path` (not following symbolic links, and
/// leaving out those `skip` names) that holds `marker`.
pub fn scan(
    path: &Path,
    marker: &[u8],
    found: &mut Vec<String>,
    skip: &dyn Fn(&Path) -> bool,
) -> Result<(), HostError> {
    if skip(path) {
        return Ok(());
    }
    let meta = match std::fs::symlink_metadata(path) {
        Ok(m) => m,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(()),
        Err(e) => return Err(io_err(path)(e)),
    };
    if meta.is_dir() {
        let entries = std::fs::read_dir(path).map_err(io_err(path))?;
        for entry in entries {
            let entry = entry.map_err(io_err(path))?;
            scan(&entry.path(), marker, found, skip)?;
        }
    } else if meta.is_file() && meta.len() <= SCAN_MAX_FILE && file_holds(path, marker)? {
        found.push(path.display().to_string());
    }
    Ok(())
}

/// Whether the file holds `marker`, read in chunks that overlap by the marker's length.
fn file_holds(path: &Path, marker: &[u8]) -> Result<bool, HostError> {
    if marker.is_empty() {
        return Ok(false);
    }
    let mut f = match std::fs::File::open(path) {
        Ok(f) => f,
        // Sockets, files removed meanwhile.
        Err(_) => return Ok(false),
    };
    let mut buf = vec![0u8; 1 << 20];
    let mut carry: Vec<u8> = Vec::new();
    loop {
        let n = f.read(&mut buf).map_err(io_err(path))?;
        if n == 0 {
            return Ok(false);
        }
        carry.extend_from_slice(&buf[..n]);
        if carry.windows(marker.len()).any(|w| w == marker) {
            return Ok(true);
        }
        let keep = marker.len().saturating_sub(1).min(carry.len());
        carry.drain(..carry.len() - keep);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn scan_finds_a_marker_across_chunk_edges_and_skips_links() {
        let dir = tempfile::tempdir().unwrap();
        let marker = b"tvm-verify-test-marker-0123";
        let mut big = vec![b'x'; (1 << 20) - 10];
        big.extend_from_slice(marker);
        std::fs::create_dir(dir.path().join("sub")).unwrap();
        std::fs::write(dir.path().join("sub/big.log"), &big).unwrap();
        std::fs::write(dir.path().join("clean"), b"nothing here").unwrap();
        std::os::unix::fs::symlink(dir.path().join("sub/big.log"), dir.path().join("link"))
            .unwrap();
        let mut found = Vec::new();
        scan(dir.path(), marker, &mut found, &skip_real_disks).unwrap();
        assert_eq!(
            found,
            vec![dir.path().join("sub/big.log").display().to_string()]
        );
        let mut none = Vec::new();
        scan(dir.path(), b"absent-marker", &mut none, &skip_real_disks).unwrap();
        assert!(none.is_empty());
        // A probe's disk is read; a real tenant's is not.
        for t in ["alice", "tvm-verify-0badc0de-rest0"] {
            std::fs::create_dir(dir.path().join(t)).unwrap();
            std::fs::write(dir.path().join(t).join("disk.img"), marker).unwrap();
        }
        let mut disks = Vec::new();
        scan(dir.path(), marker, &mut disks, &skip_real_disks).unwrap();
        assert!(
            disks
                .iter()
                .any(|p| p.ends_with("tvm-verify-0badc0de-rest0/disk.img")),
            "{disks:?}"
        );
        assert!(!disks.iter().any(|p| p.contains("alice")), "{disks:?}");
    }
}
