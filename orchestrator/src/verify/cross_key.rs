//! Trying a tenant's key against a disk safely (check 9). A disk a guest has written to is
//! hostile input: its LUKS2 header could declare a KDF cost that takes the host's memory
//! or hours of CPU. So the key is tried against a private snapshot of the header region
//! (no race with a guest rewriting it), and only after both binary headers' JSON areas
//! have been read and every keyslot's argon2 cost and every digest's PBKDF2 iterations
//! found within bounds: no more than the daemon's production keyslot cost
//! ([`KeyslotCost::PRODUCTION`]).

use std::io::Read;
use std::os::unix::fs::{DirBuilderExt, OpenOptionsExt};
use std::path::Path;

use crate::disk::{self, KeyslotCost, HEADER_BYTES};
use crate::keys::DiskKey;

/// Most PBKDF2 iterations a digest may declare (libcryptsetup benchmarks its digests to
/// well under this on any host).
pub const MAX_DIGEST_ITERATIONS: u64 = 10_000_000;
/// LUKS2 binary header: the JSON area starts after it.
const BIN_HEADER: usize = 4096;
const MAGIC_PRIMARY: &[u8] = b"LUKS\xba\xbe";
const MAGIC_SECONDARY: &[u8] = b"SKUL\xba\xbe";

/// Why a key was not tried.
#[derive(Debug, thiserror::Error)]
pub enum CrossKeyError {
    /// The header declares something the verifier will not run.
    #[error("the disk header is refused: {0}")]
    Refused(String),
    /// Reading, snapshotting or checking failed.
    #[error("{what} {path}: {message}")]
    Io {
        /// What failed.
        what: &'static str,
        /// The file.
        path: String,
        /// Why.
        message: String,
    },
}

fn refused(why: impl Into<String>) -> CrossKeyError {
    CrossKeyError::Refused(why.into())
}

fn io<'a>(what: &'static str, path: &'a Path) -> impl Fn(std::io::Error) -> CrossKeyError + 'a {
    move |e| CrossKeyError::Io {
        what,
        path: path.display().to_string(),
        message: e.to_string(),
    }
}

/// Checks one binary header at `off` of `buf` (magic `magic`) and its JSON area: returns
/// the header size it declares.
fn check_one(
    buf: &[u8],
    off: usize,
    magic: &[u8],
    max: KeyslotCost,
) -> Result<usize, CrossKeyError> {
    let head = buf
        .get(off..off + BIN_HEADER)
        .ok_or_else(|| refused(format!("no binary header at {off}")))?;
    if !head.starts_with(magic) || head[6..8] != [0, 2] {
        return Err(refused(format!("no LUKS2 header at offset {off}")));
    }
    let mut size = [0u8; 8];
    size.copy_from_slice(&head[8..16]);
    let size = u64::from_be_bytes(size);
    // The LUKS2 specification: 16 KiB to 4 MiB, a power of two.
    if !(16 << 10..=4 << 20).contains(&size) || !size.is_power_of_two() {
        return Err(refused(format!("header size {size} at offset {off}")));
    }
    let size = size as usize;
    let area = buf
        .get(off + BIN_HEADER..off + size)
        .ok_or_else(|| refused("header runs past the snapshot"))?;
    let end = area.iter().position(|b| *b == 0).unwrap_or(area.len());
    let json: serde_json::Value = serde_json::from_slice(&area[..end])
        .map_err(|e| refused(format!("JSON area at offset {off}: {e}")))?;
    check_costs(&json, max)?;
    Ok(size)
}

fn num(v: &serde_json::Value, key: &str) -> Result<u64, CrossKeyError> {
    v.get(key)
        .and_then(serde_json::Value::as_u64)
        .ok_or_else(|| refused(format!("a KDF without a numeric {key:?}")))
}

/// Every keyslot's KDF and every digest's iterations within `max`.
pub fn check_costs(json: &serde_json::Value, max: KeyslotCost) -> Result<(), CrossKeyError> {
    let slots = json
        .get("keyslots")
        .and_then(serde_json::Value::as_object)
        .ok_or_else(|| refused("no keyslots object"))?;
    for (id, slot) in slots {
        let kdf = slot
            .get("kdf")
            .ok_or_else(|| refused(format!("keyslot {id} without a KDF")))?;
        match kdf.get("type").and_then(serde_json::Value::as_str) {
            Some("argon2id" | "argon2i") => {
                let (mem, time, cpus) = (num(kdf, "memory")?, num(kdf, "time")?, num(kdf, "cpus")?);
                if mem > u64::from(max.memory_kib)
                    || time > u64::from(max.iterations)
                    || cpus > u64::from(max.threads)
                {
                    return Err(refused(format!(
                        "keyslot {id} declares argon2 {mem} KiB x {time} passes x {cpus} lanes, above the daemon's {} KiB x {} x {}",
                        max.memory_kib, max.iterations, max.threads
                    )));
                }
            }
            Some(other) => {
                return Err(refused(format!(
                    "keyslot {id} uses KDF {other:?}, which the daemon never writes"
                )))
            }
            None => return Err(refused(format!("keyslot {id} without a KDF type"))),
        }
    }
    if let Some(digests) = json.get("digests").and_then(serde_json::Value::as_object) {
        for (id, d) in digests {
            let it = num(d, "iterations")?;
            if it > MAX_DIGEST_ITERATIONS {
                return Err(refused(format!(
                    "digest {id} declares {it} PBKDF2 iterations (at most {MAX_DIGEST_ITERATIONS})"
                )));
            }
        }
    }
    Ok(())
}

/// Checks both binary headers of a header region snapshot.
pub fn check_header(buf: &[u8], max: KeyslotCost) -> Result<(), CrossKeyError> {
    let size = check_one(buf, 0, MAGIC_PRIMARY, max)?;
    // libcryptsetup falls back to the secondary header: it must be as harmless.
    check_one(buf, size, MAGIC_SECONDARY, max)?;
    Ok(())
}

/// Whether `key` opens the LUKS2 image at `image`: its header region is copied into a
/// private file under `scratch` (created 0700, removed afterwards), checked with
/// [`check_header`] against `max`, and the key tried against the copy.
pub fn snapshot_opens(
    image: &Path,
    key: &DiskKey,
    scratch: &Path,
    max: KeyslotCost,
) -> Result<bool, CrossKeyError> {
    let mut f = std::fs::File::open(image).map_err(io("open", image))?;
    let len = f.metadata().map_err(io("stat", image))?.len();
    let mut buf = Vec::with_capacity(HEADER_BYTES as usize);
    f.by_ref()
        .take(HEADER_BYTES)
        .read_to_end(&mut buf)
        .map_err(io("read", image))?;
    drop(f);
    check_header(&buf, max)?;
    std::fs::DirBuilder::new()
        .recursive(true)
        .mode(0o700)
        .create(scratch)
        .map_err(io("create", scratch))?;
    let copy = scratch.join(format!("header-{:016x}", rand::random::<u64>()));
    let result = (|| {
        let mut out = std::fs::OpenOptions::new()
            .write(true)
            .create_new(true)
            .mode(0o600)
            .open(&copy)
            .map_err(io("create", &copy))?;
        std::io::Write::write_all(&mut out, &buf).map_err(io("write", &copy))?;
        // The same apparent size as the image (sparse): the header's segment offsets hold.
        out.set_len(len.max(buf.len() as u64))
            .map_err(io("size", &copy))?;
        drop(out);
        disk::key_opens(&copy, key).map_err(|e| CrossKeyError::Io {
            what: "try the key against",
            path: copy.display().to_string(),
            message: e.to_string(),
        })
    })();
    let _ = std::fs::remove_file(&copy);
    result
}

#[cfg(test)]
mod tests {
    use super::*;

    fn image(dir: &Path, name: &str) -> (std::path::PathBuf, DiskKey) {
        let path = dir.join(name);
        let key = DiskKey::random().unwrap();
        disk::create_image(&path, 20 << 20, &key, KeyslotCost::TEST).unwrap();
        (path, key)
    }

    #[test]
    fn each_disk_opens_with_its_own_key_only_through_the_snapshot() {
        let dir = tempfile::tempdir().unwrap();
        let (a, ka) = image(dir.path(), "a.img");
        let (b, kb) = image(dir.path(), "b.img");
        let scratch = dir.path().join("scratch");
        let max = KeyslotCost::PRODUCTION;
        assert!(snapshot_opens(&a, &ka, &scratch, max).unwrap());
        assert!(snapshot_opens(&b, &kb, &scratch, max).unwrap());
        assert!(!snapshot_opens(&a, &kb, &scratch, max).unwrap());
        assert!(!snapshot_opens(&b, &ka, &scratch, max).unwrap());
        // Nothing left in the scratch directory.
        assert_eq!(std::fs::read_dir(&scratch).unwrap().count(), 0);
    }

    #[test]
    fn a_header_declaring_a_ruinous_kdf_is_refused_before_any_key_is_tried() {
        let dir = tempfile::tempdir().unwrap();
        let (a, ka) = image(dir.path(), "a.img");
        // The daemon's own cost: refused when the bound is below it.
        let tiny = KeyslotCost {
            memory_kib: 16,
            iterations: 1,
            threads: 1,
        };
        let err = snapshot_opens(&a, &ka, &dir.path().join("s"), tiny).unwrap_err();
        assert!(err.to_string().contains("argon2"), "{err}");
        // A JSON area rewritten to declare 4 GiB x 1000 passes.
        let json = serde_json::json!({
            "keyslots": {"0": {"type": "luks2", "kdf": {"type": "argon2id", "time": 1000, "memory": 4u64 << 20, "cpus": 4}}},
            "digests": {}
        });
        assert!(check_costs(&json, KeyslotCost::PRODUCTION).is_err());
        let pbkdf = serde_json::json!({
            "keyslots": {"0": {"kdf": {"type": "pbkdf2", "iterations": 1u64 << 40}}}
        });
        assert!(check_costs(&pbkdf, KeyslotCost::PRODUCTION).is_err());
        let digest = serde_json::json!({
            "keyslots": {},
            "digests": {"0": {"iterations": 1u64 << 40}}
        });
        assert!(check_costs(&digest, KeyslotCost::PRODUCTION).is_err());
        // Garbage and a plaintext file are refused, not tried.
        assert!(check_header(&[0u8; 64 << 10], KeyslotCost::PRODUCTION).is_err());
        let plain = dir.path().join("plain.img");
        std::fs::write(&plain, vec![0x53u8; 1 << 20]).unwrap();
        assert!(matches!(
            snapshot_opens(&plain, &ka, &dir.path().join("s"), KeyslotCost::PRODUCTION),
            Err(CrossKeyError::Refused(_))
        ));
    }
}
