//! The tenant's own models on its encrypted disk: `<data>/models/NAME`, where the payload
//! serves them by name (guest-image/payload/src/registry.rs). A push is written under the
//! temporary name `.NAME.partial` (which the payload never reads), checked against the
//! announced size and SHA-256, fsynced, renamed into place and the directory fsynced: the
//! payload sees the whole model or none of it, and a push that breaks off, does not match
//! or fills the disk leaves nothing behind.

use std::fs::{self, File, OpenOptions};
use std::io::{self, Read, Write};
use std::path::{Path, PathBuf};

use sha2::{Digest, Sha256};
use thiserror::Error;

use tenantvm_agent_protocol::{read_frame, ErrorCode, FrameError, ModelEntry};

/// The models directory under the data mount point.
pub const MODELS_DIR: &str = "models";
/// Kept free on the disk beyond a model's size.
pub const SPACE_MARGIN: u64 = 1 << 20;

/// Why a model could not be stored, listed or removed.
#[derive(Debug, Error)]
pub enum ModelError {
    /// A name the payload would not serve.
    #[error("Model name {0:?} is not 1-64 characters of A-Z a-z 0-9 . _ - starting with a letter, digit or _")]
    BadName(String),
    /// The announced hash is not 64 hex digits.
    #[error("The SHA-256 must be 64 lowercase hex digits")]
    BadHash,
    /// Not enough room.
    #[error("The data disk has {free} bytes free; the model needs {need} (with a {SPACE_MARGIN}-byte margin); remove a model or use a larger disk_gib")]
    NoSpace {
        /// Bytes needed.
        need: u64,
        /// Bytes free.
        free: u64,
    },
    /// What arrived is not what was announced.
    #[error("The model received does not match: {0}; nothing was stored, push it again")]
    Mismatch(String),
    /// No such model.
    #[error("No model named {0:?} is stored")]
    NotFound(String),
    /// The transfer broke off.
    #[error("The transfer broke off ({0}); nothing was stored, push it again")]
    Transfer(FrameError),
    /// The file system failed.
    #[error("Storing the model failed: {0}; nothing was stored")]
    Io(#[from] io::Error),
}

impl ModelError {
    /// The protocol's error code for it.
    pub fn code(&self) -> ErrorCode {
        match self {
            ModelError::BadName(_) | ModelError::BadHash => ErrorCode::BadRequest,
            ModelError::NoSpace { .. } => ErrorCode::NoSpace,
            ModelError::Mismatch(_) => ErrorCode::Mismatch,
            ModelError::NotFound(_) => ErrorCode::NotFound,
            ModelError::Transfer(_) | ModelError::Io(_) => ErrorCode::Internal,
        }
    }
}

/// Whether the payload serves a model under `name`.
pub fn valid_name(name: &str) -> bool {
    (1..=64).contains(&name.len())
        && !name.starts_with('.')
        && name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b"._-".contains(&b))
}

fn partial(dir: &Path, name: &str) -> PathBuf {
    dir.join(format!(".{name}.partial"))
}

/// Free bytes on the file system of `dir`.
pub fn free_bytes(dir: &Path) -> io::Result<u64> {
    let st = nix::sys::statvfs::statvfs(dir).map_err(io::Error::from)?;
    #[allow(clippy::unnecessary_cast)]
    Ok((st.blocks_available() as u64).saturating_mul(st.fragment_size() as u64))
}

/// Checks a push before its data is asked for: the name, the hash, the room.
pub fn check(dir: &Path, name: &str, size: u64, sha256: &str, free: u64) -> Result<(), ModelError> {
    if !valid_name(name) {
        return Err(ModelError::BadName(name.to_string()));
    }
    if sha256.len() != 64
        || !sha256
            .bytes()
            .all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b))
    {
        return Err(ModelError::BadHash);
    }
    let need = size.saturating_add(SPACE_MARGIN);
    if need > free {
        return Err(ModelError::NoSpace { need, free });
    }
    fs::create_dir_all(dir)?;
    Ok(())
}

/// Reads the data frames of a push from `r` (an empty frame ends it) into
/// `<dir>/.NAME.partial`, checks them and renames the file to `<dir>/NAME`. On any failure
/// the partial file is removed. Returns the bytes stored and their SHA-256.
pub fn receive(
    dir: &Path,
    name: &str,
    size: u64,
    sha256: &str,
    r: &mut impl Read,
) -> Result<(u64, String), ModelError> {
    let tmp = partial(dir, name);
    let result = write_partial(&tmp, size, sha256, r).and_then(|stored| {
        let target = dir.join(name);
        if target.is_dir() {
            fs::remove_dir_all(&target)?;
        }
        fs::rename(&tmp, &target)?;
        File::open(dir)?.sync_all()?;
        Ok(stored)
    });
    if result.is_err() {
        let _ = fs::remove_file(&tmp);
    }
    result
}

fn write_partial(
    tmp: &Path,
    size: u64,
    sha256: &str,
    r: &mut impl Read,
) -> Result<(u64, String), ModelError> {
    let _ = fs::remove_file(tmp);
    let mut file = OpenOptions::new().write(true).create_new(true).open(tmp)?;
    let mut hasher = Sha256::new();
    let mut written = 0u64;
    loop {
        let data = read_frame(r).map_err(ModelError::Transfer)?;
        if data.is_empty() {
            break;
        }
        written = written.saturating_add(data.len() as u64);
        if written > size {
            return Err(ModelError::Mismatch(format!(
                "more than the announced {size} bytes"
            )));
        }
        hasher.update(&data[..]);
        file.write_all(&data).map_err(|e| {
            if e.raw_os_error() == Some(libc::ENOSPC) {
                ModelError::NoSpace {
                    need: size,
                    free: 0,
                }
            } else {
                ModelError::Io(e)
            }
        })?;
    }
    if written != size {
        return Err(ModelError::Mismatch(format!(
            "{written} bytes, {size} announced"
        )));
    }
    let got = hex::encode(hasher.finalize());
    if got != sha256 {
        return Err(ModelError::Mismatch(format!(
            "SHA-256 {got}, {sha256} announced"
        )));
    }
    file.sync_all()?;
    Ok((written, got))
}

fn entry_bytes(path: &Path) -> u64 {
    match fs::symlink_metadata(path) {
        Ok(m) if m.is_dir() => fs::read_dir(path)
            .map(|d| d.flatten().map(|e| entry_bytes(&e.path())).sum())
            .unwrap_or(0),
        Ok(m) => m.len(),
        Err(_) => 0,
    }
}

/// The stored models (entries the payload would serve), by name.
pub fn list(dir: &Path) -> Result<Vec<ModelEntry>, ModelError> {
    let entries = match fs::read_dir(dir) {
        Ok(e) => e,
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(Vec::new()),
        Err(e) => return Err(e.into()),
    };
    let mut models: Vec<ModelEntry> = entries
        .flatten()
        .filter_map(|e| {
            let name = e.file_name().into_string().ok()?;
            valid_name(&name).then(|| ModelEntry {
                bytes: entry_bytes(&e.path()),
                name,
            })
        })
        .collect();
    models.sort_by(|a, b| a.name.cmp(&b.name));
    Ok(models)
}

/// Removes a stored model.
pub fn remove(dir: &Path, name: &str) -> Result<(), ModelError> {
    if !valid_name(name) {
        return Err(ModelError::BadName(name.to_string()));
    }
    let path = dir.join(name);
    match fs::symlink_metadata(&path) {
        Ok(m) if m.is_dir() => fs::remove_dir_all(&path)?,
        Ok(_) => fs::remove_file(&path)?,
        Err(e) if e.kind() == io::ErrorKind::NotFound => {
            return Err(ModelError::NotFound(name.to_string()))
        }
        Err(e) => return Err(e.into()),
    }
    File::open(dir)?.sync_all()?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use tenantvm_agent_protocol::encode_data;

    fn frames(data: &[u8], piece: usize, end: bool) -> Vec<u8> {
        let mut out = Vec::new();
        for c in data.chunks(piece) {
            out.extend(encode_data(c).unwrap());
        }
        if end {
            out.extend(encode_data(b"").unwrap());
        }
        out
    }

    fn sha(data: &[u8]) -> String {
        hex::encode(Sha256::digest(data))
    }

    fn visible(dir: &Path) -> Vec<String> {
        let mut v: Vec<String> = fs::read_dir(dir)
            .unwrap()
            .flatten()
            .map(|e| e.file_name().into_string().unwrap())
            .collect();
        v.sort();
        v
    }

    #[test]
    fn a_push_lands_whole_under_its_name_and_lists_and_removes() {
        let dir = tempfile::tempdir().unwrap();
        let models = dir.path().join(MODELS_DIR);
        let data = vec![7u8; 200_000];
        check(&models, "mine", data.len() as u64, &sha(&data), u64::MAX).unwrap();
        let got = receive(
            &models,
            "mine",
            data.len() as u64,
            &sha(&data),
            &mut &frames(&data, 65536, true)[..],
        )
        .unwrap();
        assert_eq!(got, (200_000, sha(&data)));
        assert_eq!(fs::read(models.join("mine")).unwrap(), data);
        assert_eq!(visible(&models), ["mine"]);
        assert_eq!(
            list(&models).unwrap(),
            [ModelEntry {
                name: "mine".into(),
                bytes: 200_000
            }]
        );
        remove(&models, "mine").unwrap();
        assert!(list(&models).unwrap().is_empty());
        assert!(matches!(
            remove(&models, "mine"),
            Err(ModelError::NotFound(_))
        ));
    }

    #[test]
    fn broken_mismatched_or_oversized_pushes_leave_nothing_visible() {
        let dir = tempfile::tempdir().unwrap();
        let models = dir.path().join(MODELS_DIR);
        fs::create_dir_all(&models).unwrap();
        let data = b"the model bytes".to_vec();
        let n = data.len() as u64;
        // Cut off before the end frame.
        let e = receive(
            &models,
            "m",
            n,
            &sha(&data),
            &mut &frames(&data, 4, false)[..],
        )
        .unwrap_err();
        assert!(matches!(e, ModelError::Transfer(_)), "{e}");
        // Wrong hash, short, long.
        let e = receive(
            &models,
            "m",
            n,
            &sha(b"other"),
            &mut &frames(&data, 4, true)[..],
        )
        .unwrap_err();
        assert_eq!(e.code(), ErrorCode::Mismatch);
        let e = receive(
            &models,
            "m",
            n + 1,
            &sha(&data),
            &mut &frames(&data, 4, true)[..],
        )
        .unwrap_err();
        assert_eq!(e.code(), ErrorCode::Mismatch);
        let e = receive(
            &models,
            "m",
            n - 1,
            &sha(&data),
            &mut &frames(&data, 4, true)[..],
        )
        .unwrap_err();
        assert_eq!(e.code(), ErrorCode::Mismatch);
        assert!(visible(&models).is_empty(), "{:?}", visible(&models));
        // A model that is there stays as it was when a new push of it fails.
        receive(
            &models,
            "m",
            n,
            &sha(&data),
            &mut &frames(&data, 4, true)[..],
        )
        .unwrap();
        let e = receive(
            &models,
            "m",
            3,
            &sha(b"abc"),
            &mut &frames(b"abd", 4, true)[..],
        )
        .unwrap_err();
        assert_eq!(e.code(), ErrorCode::Mismatch);
        assert_eq!(fs::read(models.join("m")).unwrap(), data);
        assert_eq!(visible(&models), ["m"]);
    }

    #[test]
    fn bad_names_hashes_and_a_full_disk_are_refused_before_any_data() {
        let dir = tempfile::tempdir().unwrap();
        let ok = sha(b"x");
        for bad in ["", ".hidden", "a/b", "../x", &"x".repeat(65), "sp ace"] {
            assert!(
                matches!(
                    check(dir.path(), bad, 1, &ok, u64::MAX),
                    Err(ModelError::BadName(_))
                ),
                "{bad:?}"
            );
        }
        assert!(matches!(
            check(dir.path(), "m", 1, "ABC", u64::MAX),
            Err(ModelError::BadHash)
        ));
        assert!(matches!(
            check(dir.path(), "m", 1, &ok.to_uppercase(), u64::MAX),
            Err(ModelError::BadHash)
        ));
        let e = check(dir.path(), "m", 10 << 20, &ok, 5 << 20).unwrap_err();
        assert_eq!(e.code(), ErrorCode::NoSpace);
        assert!(e.to_string().contains("disk_gib"), "{e}");
        assert!(free_bytes(dir.path()).unwrap() > 0);
    }
}
