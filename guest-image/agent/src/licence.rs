//! Installs the tenant's NVIDIA vGPU licence token (`install-licence`) where NVIDIA's
//! licensing client reads it: `<dir>/client_configuration_token_tenantvm.tok`, mode 0744 as
//! NVIDIA's guide asks, the directory (`/etc/nvidia/ClientConfigToken` in the guest) created
//! 0755 if absent. The file is written under a temporary name (created new, never through a
//! link), synced, then renamed over the previous token, so the client never reads half a
//! token. It lives in the initramfs root: guest RAM, not the tenant's disk.

use std::fs;
use std::io::{self, Write};
use std::os::unix::fs::{DirBuilderExt, OpenOptionsExt, PermissionsExt};
use std::path::{Path, PathBuf};

use tenantvm_agent_protocol::{LicenceToken, LICENCE_DIR_MODE, LICENCE_FILE, LICENCE_FILE_MODE};

/// The temporary name the token is written under before the rename.
const TEMP_FILE: &str = ".client_configuration_token_tenantvm.tok.new";

/// Why the token could not be installed.
#[derive(Debug, thiserror::Error)]
#[error("Cannot {action} {path}: {source}")]
pub struct LicenceInstallError {
    /// What was being done.
    pub action: &'static str,
    /// The file or directory.
    pub path: PathBuf,
    /// The cause.
    pub source: io::Error,
}

/// Writes `token` as the licence file in `dir`; returns the file's path.
pub fn install(dir: &Path, token: &LicenceToken) -> Result<PathBuf, LicenceInstallError> {
    let err = |action, path: &Path| {
        let path = path.to_path_buf();
        move |source| LicenceInstallError {
            action,
            path,
            source,
        }
    };
    fs::DirBuilder::new()
        .recursive(true)
        .mode(LICENCE_DIR_MODE)
        .create(dir)
        .map_err(err("create the directory", dir))?;
    let temp = dir.join(TEMP_FILE);
    let target = dir.join(LICENCE_FILE);
    // A leftover of an interrupted install is replaced, never written through.
    match fs::remove_file(&temp) {
        Ok(()) => {}
        Err(e) if e.kind() == io::ErrorKind::NotFound => {}
        Err(e) => return Err(err("remove the stale", &temp)(e)),
    }
    let written = (|| {
        let mut f = fs::OpenOptions::new()
            .write(true)
            .create_new(true)
            .mode(LICENCE_FILE_MODE)
            .custom_flags(libc::O_NOFOLLOW | libc::O_CLOEXEC)
            .open(&temp)?;
        // The umask may have narrowed the mode given at creation.
        f.set_permissions(fs::Permissions::from_mode(LICENCE_FILE_MODE))?;
        f.write_all(token.expose())?;
        f.sync_all()
    })();
    if let Err(e) = written {
        let _ = fs::remove_file(&temp);
        return Err(err("write", &temp)(e));
    }
    fs::rename(&temp, &target).map_err(err("rename the token to", &target))?;
    if let Ok(d) = fs::File::open(dir) {
        let _ = d.sync_all();
    }
    Ok(target)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn mode(p: &Path) -> u32 {
        fs::symlink_metadata(p).unwrap().permissions().mode() & 0o7777
    }

    #[test]
    fn the_token_lands_whole_with_nvidias_modes_and_replaces_the_last_one() {
        let root = tempfile::tempdir().unwrap();
        let dir = root.path().join("etc/nvidia/ClientConfigToken");
        let first = LicenceToken::new(b"first-token\n").unwrap();
        let path = install(&dir, &first).unwrap();
        assert_eq!(path, dir.join(LICENCE_FILE));
        assert_eq!(fs::read(&path).unwrap(), b"first-token\n");
        assert_eq!(mode(&path), 0o744);
        assert_eq!(mode(&dir), 0o755);
        let second = LicenceToken::new(b"second").unwrap();
        install(&dir, &second).unwrap();
        assert_eq!(fs::read(&path).unwrap(), b"second");
        let names: Vec<_> = fs::read_dir(&dir)
            .unwrap()
            .map(|e| e.unwrap().file_name())
            .collect();
        assert_eq!(names, [std::ffi::OsString::from(LICENCE_FILE)]);
    }

    #[test]
    fn links_planted_at_either_name_are_replaced_not_followed() {
        let root = tempfile::tempdir().unwrap();
        let dir = root.path().join("tok");
        fs::create_dir(&dir).unwrap();
        let victim = root.path().join("victim");
        fs::write(&victim, b"keep me").unwrap();
        std::os::unix::fs::symlink(&victim, dir.join(TEMP_FILE)).unwrap();
        std::os::unix::fs::symlink(&victim, dir.join(LICENCE_FILE)).unwrap();
        install(&dir, &LicenceToken::new(b"tok").unwrap()).unwrap();
        assert_eq!(fs::read(&victim).unwrap(), b"keep me");
        assert!(fs::symlink_metadata(dir.join(LICENCE_FILE))
            .unwrap()
            .file_type()
            .is_file());
        assert_eq!(fs::read(dir.join(LICENCE_FILE)).unwrap(), b"tok");
    }

    #[test]
    fn a_directory_that_cannot_be_made_is_an_error_naming_it() {
        let root = tempfile::tempdir().unwrap();
        let blocker = root.path().join("file");
        fs::write(&blocker, b"").unwrap();
        let err = install(&blocker.join("sub"), &LicenceToken::new(b"t").unwrap()).unwrap_err();
        assert!(err.to_string().contains("create the directory"), "{err}");
    }
}
