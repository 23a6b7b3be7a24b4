//! Private files: created 0600, written atomically (temporary file, fsync, rename, fsync of the
//! directory), and checked to be root-only when read.

use std::fs::{self, File, OpenOptions};
use std::io::{self, Read, Write};
use std::os::unix::fs::{MetadataExt, OpenOptionsExt, PermissionsExt};
use std::path::Path;

/// Why a private file was refused when read.
#[derive(Debug, thiserror::Error)]
pub enum PrivateFileError {
    /// The file could not be read.
    #[error("Cannot read {path}: {source}")]
    Read {
        /// The file.
        path: String,
        /// The I/O error.
        source: io::Error,
    },
    /// Group or others may access the file.
    #[error("File {path} has mode {mode:o}; it must be readable by its owner only (chmod 600 it, and check who else may have read it)")]
    TooOpen {
        /// The file.
        path: String,
        /// Its permission bits.
        mode: u32,
    },
    /// The file belongs to another user.
    #[error("File {path} is owned by uid {uid}, not by this process's uid {euid}; chown it or run as its owner")]
    WrongOwner {
        /// The file.
        path: String,
        /// The owner.
        uid: u32,
        /// This process's effective uid.
        euid: u32,
    },
}

/// Creates `dir` and any missing parents with mode 0700 (existing ones are left as they are):
/// file names in key and audit directories (tenant ids) are nobody else's business either.
pub(crate) fn create_private_dir(dir: &Path) -> io::Result<()> {
    use std::os::unix::fs::DirBuilderExt;
    fs::DirBuilder::new()
        .recursive(true)
        .mode(0o700)
        .create(dir)
}

/// Writes `contents` to `path` with mode 0600, atomically: a crash leaves either the old file or
/// the new one, never a torn one.
pub(crate) fn write_private_atomic(path: &Path, contents: &[u8]) -> io::Result<()> {
    let dir = path.parent().unwrap_or(Path::new("."));
    create_private_dir(dir)?;
    let name = path
        .file_name()
        .ok_or_else(|| io::Error::new(io::ErrorKind::InvalidInput, "path has no file name"))?;
    let tmp = dir.join(format!(".{}.tmp", name.to_string_lossy()));
    let _ = fs::remove_file(&tmp);
    {
        let mut file = OpenOptions::new()
            .write(true)
            .create_new(true)
            .mode(0o600)
            .open(&tmp)?;
        file.write_all(contents)?;
        file.sync_all()?;
    }
    fs::rename(&tmp, path)?;
    sync_dir(dir)
}

/// Creates `path` with `contents` and mode 0600 only if it does not exist yet, atomically
/// (the file appears complete or not at all). Returns false, writing nothing, if it existed:
/// of two racing creators exactly one wins.
pub(crate) fn create_private_new(path: &Path, contents: &[u8]) -> io::Result<bool> {
    let dir = path.parent().unwrap_or(Path::new("."));
    create_private_dir(dir)?;
    let name = path
        .file_name()
        .ok_or_else(|| io::Error::new(io::ErrorKind::InvalidInput, "path has no file name"))?;
    let mut suffix = [0u8; 8];
    rand::RngCore::fill_bytes(&mut rand::rng(), &mut suffix);
    let tmp = dir.join(format!(
        ".{}.{}.new",
        name.to_string_lossy(),
        hex::encode(suffix)
    ));
    {
        let mut file = OpenOptions::new()
            .write(true)
            .create_new(true)
            .mode(0o600)
            .open(&tmp)?;
        file.write_all(contents)?;
        file.sync_all()?;
    }
    // link(2) fails with EEXIST instead of replacing, unlike rename(2).
    let linked = fs::hard_link(&tmp, path);
    let _ = fs::remove_file(&tmp);
    match linked {
        Ok(()) => {
            sync_dir(dir)?;
            Ok(true)
        }
        Err(e) if e.kind() == io::ErrorKind::AlreadyExists => Ok(false),
        Err(e) => Err(e),
    }
}

/// Makes a directory's entries (creations, renames, removals) durable.
pub(crate) fn sync_dir(dir: &Path) -> io::Result<()> {
    File::open(dir)?.sync_all()
}

/// Reads a private file after checking that only its owner (this process's user) can read it.
/// `limit` bounds how much is read, so a wrong path cannot exhaust memory.
pub(crate) fn read_private(path: &Path, limit: u64) -> Result<Vec<u8>, PrivateFileError> {
    let shown = path.display().to_string();
    let read_err = |source| PrivateFileError::Read {
        path: shown.clone(),
        source,
    };
    let file = File::open(path).map_err(read_err)?;
    let meta = file.metadata().map_err(read_err)?;
    let mode = meta.permissions().mode() & 0o777;
    if mode & 0o077 != 0 {
        return Err(PrivateFileError::TooOpen { path: shown, mode });
    }
    // SAFETY: geteuid has no preconditions and cannot fail.
    let euid = unsafe { libc::geteuid() };
    if meta.uid() != euid {
        return Err(PrivateFileError::WrongOwner {
            path: shown,
            uid: meta.uid(),
            euid,
        });
    }
    let mut contents = Vec::new();
    file.take(limit)
        .read_to_end(&mut contents)
        .map_err(read_err)?;
    Ok(contents)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn written_file_is_owner_only_and_readable_back() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("sub").join("secret");
        write_private_atomic(&path, b"abc").unwrap();
        let mode = fs::metadata(&path).unwrap().permissions().mode() & 0o777;
        assert_eq!(mode, 0o600);
        assert_eq!(read_private(&path, 1024).unwrap(), b"abc");
    }

    #[test]
    fn missing_directories_are_created_owner_only() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("a").join("b").join("secret");
        write_private_atomic(&path, b"x").unwrap();
        for d in [dir.path().join("a"), dir.path().join("a").join("b")] {
            assert_eq!(
                fs::metadata(&d).unwrap().permissions().mode() & 0o777,
                0o700
            );
        }
    }

    #[test]
    fn create_new_never_replaces_an_existing_file() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("k");
        assert!(create_private_new(&path, b"first").unwrap());
        assert!(!create_private_new(&path, b"second").unwrap());
        assert_eq!(fs::read(&path).unwrap(), b"first");
        assert_eq!(
            fs::read_dir(dir.path()).unwrap().count(),
            1,
            "temporary file left behind"
        );
    }

    #[test]
    fn read_refuses_group_readable_file() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("secret");
        write_private_atomic(&path, b"abc").unwrap();
        fs::set_permissions(&path, fs::Permissions::from_mode(0o640)).unwrap();
        let err = read_private(&path, 1024).unwrap_err();
        assert!(
            matches!(err, PrivateFileError::TooOpen { mode: 0o640, .. }),
            "{err}"
        );
    }
}
