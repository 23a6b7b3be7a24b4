//! Crypto-shred of a tenant's LUKS2 image.
//!
//! The data area is AES-XTS ciphertext under a volume key that exists only inside the header's
//! keyslots. Overwriting the whole header region we laid out (both binary headers, both JSON
//! areas, the keyslot area: the first [`HEADER_BYTES`]) leaves no copy of the volume key, so
//! the ciphertext is unrecoverable whoever holds the tenant key. The image is then discarded
//! (hole punched) and deleted.
//!
//! The header is *not* parsed before it is destroyed: the guest has had the whole image, so its
//! header is hostile input, and libcryptsetup would run as root over guest-written JSON (and a
//! guest could declare a huge data offset to make us overwrite gigabytes). Our fixed layout
//! tells where the keyslots are. A keyslot the guest added beyond it can hold only the volume
//! key the guest already knows, under a passphrase of its own, and it is discarded with the
//! rest of the image.

use std::fs::{self, OpenOptions};
use std::io;
use std::os::fd::AsRawFd;
use std::os::unix::fs::FileExt;
use std::path::Path;

use rand::RngCore;
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};

use super::{io_err, key_opens, DiskError, HEADER_BYTES};
use crate::keys::{sync_dir, DiskKey, KeyError, KeyStore};
use crate::receipt::{Assurance, DepartureStep, StepRecord, StepResult};

const CHUNK: usize = 1 << 20;
const LUKS2_MAGIC_PRIMARY: &[u8; 6] = b"LUKS\xba\xbe";
const LUKS2_MAGIC_SECONDARY: &[u8; 6] = b"SKUL\xba\xbe";

/// What [`shred_image`] did and checked; the evidence for the departure receipt.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ShredReport {
    /// The image file.
    pub image: String,
    /// The image was already gone (an earlier run finished this step).
    pub already_gone: bool,
    /// Bytes of header region (from offset 0) overwritten with random data.
    pub header_bytes_overwritten: u64,
    /// SHA-256 of the header region before the overwrite (identifies what was destroyed).
    pub header_sha256_before: Option<String>,
    /// SHA-256 of the random data written, which the read-back matched.
    pub header_sha256_after: Option<String>,
    /// The read-back of the header region found no LUKS2 magic and matched what was written.
    pub header_overwrite_verified: bool,
    /// The old tenant key was tried against the image after the overwrite and refused.
    /// `None` when no key was supplied (it had been deleted by an earlier run).
    pub old_key_rejected: Option<bool>,
    /// Bytes deallocated with `FALLOC_FL_PUNCH_HOLE` (0 if the filesystem cannot punch holes).
    pub bytes_discarded: u64,
    /// The image file was unlinked and the directory synced.
    pub deleted: bool,
}

/// What [`crypto_shred`] did: the header destruction, the wrapped key and the discard.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct CryptoShredReport {
    /// The tenant.
    pub tenant: String,
    /// Header destruction and image removal.
    pub image: ShredReport,
    /// The wrapped key file existed and was overwritten and removed by this run (false when an
    /// earlier run had already removed it).
    pub wrapped_key_deleted: bool,
    /// No wrapped key is left for the tenant.
    pub wrapped_key_absent: bool,
}

/// How the crypto-shred is done, as the receipt states it.
pub const SHRED_METHOD: &str = "LUKS2 header region (both binary headers, JSON areas, every keyslot) overwritten with random bytes and read back; old key tried; wrapped key overwritten and unlinked; image hole-punched and unlinked";

impl CryptoShredReport {
    /// Whether every part of the shred was checked: header overwrite read back, old key
    /// refused (when it was still there to try), wrapped key gone, image gone.
    pub fn verified(&self) -> bool {
        let header_ok = self.image.header_overwrite_verified || self.image.already_gone;
        header_ok
            && self.image.old_key_rejected != Some(false)
            && self.wrapped_key_absent
            && (self.image.deleted || self.image.already_gone)
    }

    /// The receipt's record of this step.
    pub fn step_record(&self, started_at: String, finished_at: String) -> StepRecord {
        let i = &self.image;
        let mut e = std::collections::BTreeMap::new();
        // Its name only: the receipt is the tenant's to read, the host's paths are not.
        let name = Path::new(&i.image)
            .file_name()
            .map_or_else(|| "disk image".into(), |n| n.to_string_lossy().into_owned());
        e.insert(
            "image".to_string(),
            format!("{name} (in the tenant's directory)"),
        );
        e.insert(
            "header_bytes_overwritten".to_string(),
            i.header_bytes_overwritten.to_string(),
        );
        if let Some(h) = &i.header_sha256_before {
            e.insert("header_sha256_before".to_string(), h.clone());
        }
        if let Some(h) = &i.header_sha256_after {
            e.insert("header_sha256_after".to_string(), h.clone());
        }
        let rejected = i
            .old_key_rejected
            .map_or("not tried (key already deleted)".to_string(), |r| {
                r.to_string()
            });
        e.insert("old_key_rejected".to_string(), rejected);
        e.insert(
            "wrapped_key_deleted".to_string(),
            self.wrapped_key_deleted.to_string(),
        );
        e.insert(
            "wrapped_key_absent".to_string(),
            self.wrapped_key_absent.to_string(),
        );
        e.insert("bytes_discarded".to_string(), i.bytes_discarded.to_string());
        e.insert(
            "image_deleted".to_string(),
            (i.deleted || i.already_gone).to_string(),
        );
        let verified = self.verified();
        StepRecord {
            step: DepartureStep::CryptoShred,
            method: SHRED_METHOD.to_string(),
            result: if verified {
                StepResult::Ok
            } else {
                StepResult::Failed
            },
            assurance: if verified {
                Assurance::Verified
            } else {
                Assurance::Unverified
            },
            started_at,
            finished_at,
            evidence: e,
            error: (!verified).then(|| "the shred could not be fully verified".to_string()),
        }
    }
}

/// The departure's crypto-shred step: destroys the image's header (verifying that the tenant's
/// key no longer opens it), deletes the wrapped key, then discards and deletes the image.
///
/// Idempotent and resumable: each part tolerates an earlier run having done it, so a daemon
/// killed anywhere in here finishes the job when it calls this again.
pub fn crypto_shred(
    keys: &KeyStore,
    tenant: &str,
    image: &Path,
) -> Result<CryptoShredReport, DiskError> {
    let old_key = match keys.unwrap(tenant) {
        Ok(key) => Some(key),
        Err(KeyError::NotFound(_)) => None,
        Err(e) => return Err(e.into()),
    };
    let mut report = destroy_header(image, old_key.as_ref())?;
    drop(old_key);
    let wrapped_key_deleted = keys.delete(tenant)?;
    let wrapped_key_absent = !keys.exists(tenant)?;
    discard_image(image, &mut report)?;
    Ok(CryptoShredReport {
        tenant: tenant.to_string(),
        image: report,
        wrapped_key_deleted,
        wrapped_key_absent,
    })
}

/// Overwrites the header region (every keyslot included) with random bytes and reads it back,
/// checks that `old_key` (when given) no longer opens the image, then discards and deletes the
/// image. [`crypto_shred`] is this plus the wrapped key's deletion between the two halves.
pub fn shred_image(path: &Path, old_key: Option<&DiskKey>) -> Result<ShredReport, DiskError> {
    let mut report = destroy_header(path, old_key)?;
    discard_image(path, &mut report)?;
    Ok(report)
}

/// The first half of the shred: header region (every keyslot included) overwritten with random
/// bytes and verified, the old key tried. Leaves the (now undecryptable) image in place.
pub fn destroy_header(path: &Path, old_key: Option<&DiskKey>) -> Result<ShredReport, DiskError> {
    let mut report = ShredReport {
        image: path.display().to_string(),
        already_gone: false,
        header_bytes_overwritten: 0,
        header_sha256_before: None,
        header_sha256_after: None,
        header_overwrite_verified: false,
        old_key_rejected: None,
        bytes_discarded: 0,
        deleted: false,
    };
    if !path.exists() {
        report.already_gone = true;
        return Ok(report);
    }

    // 1. Overwrite the whole header region with random bytes, then read it back.
    let file = OpenOptions::new()
        .read(true)
        .write(true)
        .open(path)
        .map_err(io_err("open", path))?;
    let file_len = file.metadata().map_err(io_err("stat", path))?.len();
    let header_len = HEADER_BYTES.min(file_len);
    let before = hash_range(&file, header_len).map_err(io_err("read", path))?;
    report.header_sha256_before = Some(hex::encode(before));
    let written = overwrite_random(&file, header_len).map_err(io_err("overwrite", path))?;
    file.sync_all().map_err(io_err("sync", path))?;
    drop_page_cache(&file, header_len);
    let (read_back, magic_found) =
        hash_and_scan(&file, header_len).map_err(io_err("read back", path))?;
    report.header_bytes_overwritten = header_len;
    report.header_sha256_after = Some(hex::encode(written));
    report.header_overwrite_verified = read_back == written && !magic_found;
    if !report.header_overwrite_verified {
        return Err(DiskError::ShredUnverified {
            path: path.display().to_string(),
            reason: "the read-back of the header region differs from what was written",
        });
    }
    drop(file);

    // 2. The old key must no longer open anything (the header parsed now is our random bytes).
    if let Some(key) = old_key {
        let opens = key_opens(path, key)?;
        report.old_key_rejected = Some(!opens);
        if opens {
            return Err(DiskError::ShredUnverified {
                path: path.display().to_string(),
                reason: "the old key still opens the image after the overwrite",
            });
        }
    }
    Ok(report)
}

/// The second half of the shred: punches a hole over the whole image, then unlinks it and
/// syncs the directory. A missing image is fine (an earlier run removed it).
pub fn discard_image(path: &Path, report: &mut ShredReport) -> Result<(), DiskError> {
    let file = match OpenOptions::new().write(true).open(path) {
        Ok(file) => file,
        Err(e) if e.kind() == io::ErrorKind::NotFound => {
            report.already_gone |= !report.deleted;
            return Ok(());
        }
        Err(e) => return Err(io_err("open", path)(e)),
    };
    let file_len = file.metadata().map_err(io_err("stat", path))?.len();
    report.bytes_discarded = punch_hole(&file, file_len).map_err(io_err("discard", path))?;
    file.sync_all().map_err(io_err("sync", path))?;
    drop(file);
    fs::remove_file(path).map_err(io_err("remove", path))?;
    let dir = match path.parent() {
        Some(dir) if !dir.as_os_str().is_empty() => dir,
        _ => Path::new("."),
    };
    sync_dir(dir).map_err(io_err("sync the directory of", path))?;
    report.deleted = true;
    Ok(())
}

fn hash_range(file: &fs::File, len: u64) -> io::Result<[u8; 32]> {
    Ok(hash_and_scan(file, len)?.0)
}

/// SHA-256 of `[0, len)` and whether a LUKS2 magic appears anywhere in it.
fn hash_and_scan(file: &fs::File, len: u64) -> io::Result<([u8; 32], bool)> {
    let mut hasher = Sha256::new();
    let mut buf = vec![0u8; CHUNK];
    let mut found = false;
    let mut offset = 0u64;
    while offset < len {
        let n = usize::try_from((len - offset).min(CHUNK as u64)).unwrap_or(CHUNK);
        file.read_exact_at(&mut buf[..n], offset)?;
        hasher.update(&buf[..n]);
        // LUKS2 binary headers start on 4 KiB boundaries (the secondary at 16 KiB to 4 MiB);
        // check every 512-byte boundary.
        found |= buf[..n].chunks(512).any(|sector| {
            sector.starts_with(LUKS2_MAGIC_PRIMARY) || sector.starts_with(LUKS2_MAGIC_SECONDARY)
        });
        offset += n as u64;
    }
    Ok((hasher.finalize().into(), found))
}

/// Writes fresh random bytes over `[0, len)`; returns their SHA-256.
fn overwrite_random(file: &fs::File, len: u64) -> io::Result<[u8; 32]> {
    let mut rng = rand::rng();
    let mut hasher = Sha256::new();
    let mut buf = vec![0u8; CHUNK];
    let mut offset = 0u64;
    while offset < len {
        let n = usize::try_from((len - offset).min(CHUNK as u64)).unwrap_or(CHUNK);
        rng.fill_bytes(&mut buf[..n]);
        file.write_all_at(&buf[..n], offset)?;
        hasher.update(&buf[..n]);
        offset += n as u64;
    }
    Ok(hasher.finalize().into())
}

/// Asks the kernel to drop cached pages so the read-back comes from the disk (best effort).
fn drop_page_cache(file: &fs::File, len: u64) {
    let len = libc::off_t::try_from(len).unwrap_or(libc::off_t::MAX);
    // SAFETY: posix_fadvise only reads its integer arguments; the fd is open for the call.
    unsafe { libc::posix_fadvise(file.as_raw_fd(), 0, len, libc::POSIX_FADV_DONTNEED) };
}

/// Deallocates `[0, len)` keeping the size; returns the bytes punched, 0 if unsupported.
fn punch_hole(file: &fs::File, len: u64) -> io::Result<u64> {
    let Ok(off_len) = libc::off_t::try_from(len) else {
        return Err(io::Error::other("image larger than off_t"));
    };
    // SAFETY: fallocate only reads its integer arguments; the fd is open for writing.
    let rc = unsafe {
        libc::fallocate(
            file.as_raw_fd(),
            libc::FALLOC_FL_PUNCH_HOLE | libc::FALLOC_FL_KEEP_SIZE,
            0,
            off_len,
        )
    };
    if rc == 0 {
        return Ok(len);
    }
    let err = io::Error::last_os_error();
    if err.raw_os_error() == Some(libc::EOPNOTSUPP) {
        Ok(0)
    } else {
        Err(err)
    }
}
