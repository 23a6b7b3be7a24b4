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

/// What [`write_secret`] does when `path` already holds a file.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Existing {
    /// Replace it (tokens, rewrapped keys): the new file takes its place atomically, with
    /// mode 0600 whatever the old file's mode was.
    Replace,
    /// Keep it and write nothing (the KEK, the signing key, a tenant's wrapped key): of two
    /// racing creators exactly one wins.
    Keep,
}

/// The one writer of secrets (tokens, the admin token, the host KEK, the receipt signing key,
/// wrapped disk keys): the contents go to a fresh temporary file in the same directory,
/// created with `O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC` and mode 0600 (set with fchmod,
/// so the umask cannot widen it), synced, then renamed over `path` ([`Existing::Replace`]) or
/// linked to it ([`Existing::Keep`]: link(2) never replaces), and the directory is synced. A
/// crash leaves the old file or the new one, never a torn one. A symbolic link (or anything
/// but a regular file) at `path` is refused, never followed. The directory must exist.
/// Returns whether the file was written (false: [`Existing::Keep`] found one).
pub fn write_secret(path: &Path, contents: &[u8], existing: Existing) -> io::Result<bool> {
    write_atomic(path, contents, 0o600, existing)
}

/// [`write_secret`] for a file that is not secret but must be replaced whole and never
/// written through a symlink (the receipt public key, mode 0644).
pub(crate) fn write_public(path: &Path, contents: &[u8]) -> io::Result<()> {
    write_atomic(path, contents, 0o644, Existing::Replace).map(|_| ())
}

/// Whether [`write_secret`] could write `path` now: it is no symbolic link and no other
/// kind of file than a regular one, and a file can be made beside it (one is made and
/// removed). For a secret that exists only once (a new tenant's token), checked before it
/// is asked for, so that it is never made only to be lost.
pub fn check_secret_path(path: &Path) -> io::Result<()> {
    let (dir, name) = dir_and_name(path)?;
    check_target(path)?;
    let probe = dir.join(format!(".{}.probe.tmp", name.to_string_lossy()));
    OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o600)
        .custom_flags(libc::O_NOFOLLOW | libc::O_CLOEXEC)
        .open(&probe)?;
    fs::remove_file(&probe)
}

fn dir_and_name(path: &Path) -> io::Result<(&Path, &std::ffi::OsStr)> {
    let dir = match path.parent() {
        Some(d) if !d.as_os_str().is_empty() => d,
        _ => Path::new("."),
    };
    let name = path
        .file_name()
        .ok_or_else(|| io::Error::new(io::ErrorKind::InvalidInput, "path has no file name"))?;
    Ok((dir, name))
}

/// Refuses a symbolic link or another kind of file than a regular one at `path`; true when
/// a file is there.
fn check_target(path: &Path) -> io::Result<bool> {
    match fs::symlink_metadata(path) {
        Ok(meta) if meta.file_type().is_symlink() => Err(io::Error::new(
            io::ErrorKind::InvalidInput,
            format!(
                "{} is a symbolic link; a secret is never written through one (remove it, or give another path)",
                path.display()
            ),
        )),
        Ok(meta) if !meta.is_file() => Err(io::Error::new(
            io::ErrorKind::InvalidInput,
            format!("{} exists and is not a regular file", path.display()),
        )),
        Ok(_) => Ok(true),
        Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(false),
        Err(e) => Err(e),
    }
}

fn write_atomic(path: &Path, contents: &[u8], mode: u32, existing: Existing) -> io::Result<bool> {
    let (dir, name) = dir_and_name(path)?;
    if check_target(path)? && existing == Existing::Keep {
        return Ok(false);
    }
    let mut suffix = [0u8; 8];
    rand::RngCore::fill_bytes(&mut rand::rng(), &mut suffix);
    let tmp = dir.join(format!(
        ".{}.{}.tmp",
        name.to_string_lossy(),
        hex::encode(suffix)
    ));
    let written = (|| -> io::Result<()> {
        let mut file = OpenOptions::new()
            .write(true)
            .create_new(true)
            .mode(mode)
            .custom_flags(libc::O_NOFOLLOW | libc::O_CLOEXEC)
            .open(&tmp)?;
        file.set_permissions(fs::Permissions::from_mode(mode))?;
        file.write_all(contents)?;
        file.sync_all()
    })();
    let placed = written.and_then(|()| match existing {
        // rename(2) replaces the directory entry itself, never what a symlink points to.
        Existing::Replace => fs::rename(&tmp, path).map(|()| true),
        // link(2) fails with EEXIST instead of replacing, unlike rename(2).
        Existing::Keep => match fs::hard_link(&tmp, path) {
            Ok(()) => Ok(true),
            Err(e) if e.kind() == io::ErrorKind::AlreadyExists => Ok(false),
            Err(e) => Err(e),
        },
    });
    // After a rename the temporary name is gone already; otherwise remove it.
    let _ = fs::remove_file(&tmp);
    let wrote = placed?;
    if wrote {
        sync_dir(dir)?;
    }
    Ok(wrote)
}

/// Writes `contents` to `path` with mode 0600, atomically ([`write_secret`], replacing),
/// creating the directory (0700) first.
pub(crate) fn write_private_atomic(path: &Path, contents: &[u8]) -> io::Result<()> {
    let dir = path.parent().unwrap_or(Path::new("."));
    create_private_dir(dir)?;
    write_secret(path, contents, Existing::Replace).map(|_| ())
}

/// Creates `path` with `contents` and mode 0600 only if it does not exist yet, atomically
/// ([`write_secret`], keeping an existing file), creating the directory (0700) first.
/// Returns false, writing nothing, if it existed: of two racing creators exactly one wins.
pub(crate) fn create_private_new(path: &Path, contents: &[u8]) -> io::Result<bool> {
    let dir = path.parent().unwrap_or(Path::new("."));
    create_private_dir(dir)?;
    write_secret(path, contents, Existing::Keep)
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
    let file = OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NOFOLLOW | libc::O_CLOEXEC)
        .open(path)
        .map_err(read_err)?;
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

    fn names_in(dir: &Path) -> Vec<String> {
        let mut names: Vec<String> = fs::read_dir(dir)
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .collect();
        names.sort();
        names
    }

    #[test]
    fn replacing_an_open_file_makes_it_0600_and_leaves_no_temporary() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("token");
        fs::write(&path, "old, longer than the new contents").unwrap();
        fs::set_permissions(&path, fs::Permissions::from_mode(0o666)).unwrap();
        assert!(write_secret(&path, b"new", Existing::Replace).unwrap());
        assert_eq!(fs::read(&path).unwrap(), b"new");
        assert_eq!(
            fs::metadata(&path).unwrap().permissions().mode() & 0o777,
            0o600
        );
        assert_eq!(names_in(dir.path()), ["token"]);
    }

    #[test]
    fn a_symlink_is_never_followed_nor_replaced() {
        let dir = tempfile::tempdir().unwrap();
        let target = dir.path().join("target");
        fs::write(&target, "keep me").unwrap();
        let link = dir.path().join("secret");
        std::os::unix::fs::symlink(&target, &link).unwrap();
        for existing in [Existing::Replace, Existing::Keep] {
            let err = write_secret(&link, b"x", existing).unwrap_err();
            assert!(err.to_string().contains("symbolic link"), "{err}");
        }
        assert_eq!(fs::read(&target).unwrap(), b"keep me");
        assert!(fs::symlink_metadata(&link)
            .unwrap()
            .file_type()
            .is_symlink());
        assert_eq!(names_in(dir.path()), ["secret", "target"]);
        // Reading a secret through a symlink is refused too.
        read_private(&link, 16).unwrap_err();
    }

    #[test]
    fn a_directory_in_the_way_is_refused() {
        let dir = tempfile::tempdir().unwrap();
        fs::create_dir(dir.path().join("d")).unwrap();
        write_secret(&dir.path().join("d"), b"x", Existing::Replace).unwrap_err();
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
