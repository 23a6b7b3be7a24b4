//! Host KEK rotation: every wrapped key re-sealed under a fresh KEK, then the KEK file replaced.
//!
//! Offline (daemon stopped) and resumable: the new KEK is created as `<kek>.next` and reused if
//! a crash left it there, blobs already sealed under it are skipped (their KEK id says so), and
//! the KEK file is replaced by an atomic rename only when every blob has been re-sealed. While
//! `<kek>.next` exists, [`HostKek::load`] refuses to start with the old KEK.

use std::fs;
use std::path::{Path, PathBuf};

use serde::Serialize;

use zeroize::Zeroizing;

use super::licence::{LICENCE_SEAL, LICENCE_SUFFIX, MAX_LICENCE_BYTES};
use super::{
    check_tenant_id, read_private, sync_dir, write_private_atomic, HostKek, KeyError, SealKind,
    DISK_KEY_SEAL, KEK_ID_BYTES, SEAL_OVERHEAD, WRAPPED_BYTES,
};

/// What [`rotate_kek`] did.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct RotationReport {
    /// Id of the KEK replaced.
    pub old_kek_id: String,
    /// Id of the KEK now in place.
    pub new_kek_id: String,
    /// Keys re-sealed by this run.
    pub rewrapped: usize,
    /// Keys an interrupted earlier run had already re-sealed.
    pub already_rewrapped: usize,
}

/// Where a rotation keeps the new KEK until it is complete.
pub fn next_kek_path(kek: &Path) -> PathBuf {
    let mut name = kek.as_os_str().to_owned();
    name.push(".next");
    PathBuf::from(name)
}

/// What a file in the key directory holds, by its suffix, and the most it may hold.
fn sealed_kind(name: &str) -> Option<(&str, &'static SealKind, usize)> {
    if let Some(t) = name.strip_suffix(".wrapped") {
        return Some((t, &DISK_KEY_SEAL, WRAPPED_BYTES));
    }
    name.strip_suffix(LICENCE_SUFFIX)
        .map(|t| (t, &LICENCE_SEAL, SEAL_OVERHEAD + MAX_LICENCE_BYTES))
}

/// Re-seals every wrapped key (and sealed vGPU licence) in `key_dir` under a fresh KEK and makes that KEK the one at
/// `kek_path`. The tenant keys themselves do not change, so no disk needs touching.
pub fn rotate_kek(kek_path: &Path, key_dir: &Path) -> Result<RotationReport, KeyError> {
    let io_err = |action, path: &Path, source| KeyError::Io {
        action,
        path: path.display().to_string(),
        source,
    };
    let old = HostKek::read(kek_path)?;
    let next = next_kek_path(kek_path);
    let new = HostKek::create_or_read_file(&next)?;
    let mut report = RotationReport {
        old_kek_id: old.id_hex(),
        new_kek_id: new.id_hex(),
        rewrapped: 0,
        already_rewrapped: 0,
    };
    let entries = fs::read_dir(key_dir).map_err(|e| io_err("list", key_dir, e))?;
    for entry in entries {
        let path = entry.map_err(|e| io_err("list", key_dir, e))?.path();
        let Some((tenant, kind, max)) = path
            .file_name()
            .and_then(|n| n.to_str())
            .and_then(sealed_kind)
            .filter(|(t, _, _)| check_tenant_id(t).is_ok())
        else {
            continue;
        };
        let blob = read_private(&path, max as u64 + 1)?;
        let id_range = kind.magic.len()..kind.magic.len() + KEK_ID_BYTES;
        if blob.len() >= SEAL_OVERHEAD && blob[id_range] == new.id {
            report.already_rewrapped += 1;
            continue;
        }
        let secret = Zeroizing::new(old.open(kind, tenant, &blob)?);
        let sealed = new.seal(kind, tenant, &secret)?;
        write_private_atomic(&path, &sealed).map_err(|e| io_err("rewrite", &path, e))?;
        report.rewrapped += 1;
    }
    fs::rename(&next, kek_path).map_err(|e| io_err("replace", kek_path, e))?;
    let dir = kek_path.parent().unwrap_or(Path::new("."));
    sync_dir(dir).map_err(|e| io_err("sync the directory of", kek_path, e))?;
    Ok(report)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::keys::{DiskKey, KekSource, KeyStore};

    struct Setup {
        _dir: tempfile::TempDir,
        kek: PathBuf,
        keys: PathBuf,
    }

    fn setup(tenants: &[&str]) -> (Setup, Vec<[u8; 64]>) {
        let dir = tempfile::tempdir().unwrap();
        let kek = dir.path().join("kek");
        let keys = dir.path().join("keys");
        let store =
            KeyStore::new(&keys, HostKek::load(&KekSource::File(kek.clone())).unwrap()).unwrap();
        let created = tenants
            .iter()
            .map(|t| *store.create(t).unwrap().expose())
            .collect();
        (
            Setup {
                _dir: dir,
                kek,
                keys,
            },
            created,
        )
    }

    fn store(s: &Setup) -> KeyStore {
        KeyStore::new(
            &s.keys,
            HostKek::load(&KekSource::File(s.kek.clone())).unwrap(),
        )
        .unwrap()
    }

    #[test]
    fn rotation_reseals_every_key_under_a_new_kek() {
        let (s, created) = setup(&["a", "b", "c"]);
        let old_id = store(&s).kek.id_hex();
        let report = rotate_kek(&s.kek, &s.keys).unwrap();
        assert_eq!(report.rewrapped, 3);
        assert_eq!(report.old_kek_id, old_id);
        assert!(!next_kek_path(&s.kek).exists());
        let after = store(&s);
        assert_eq!(after.kek.id_hex(), report.new_kek_id);
        assert_ne!(report.new_kek_id, old_id);
        for (t, key) in ["a", "b", "c"].iter().zip(&created) {
            assert_eq!(after.unwrap(t).unwrap().expose(), key);
        }
    }

    #[test]
    fn interrupted_rotation_blocks_startup_and_resumes() {
        let (s, created) = setup(&["a", "b"]);
        // A crash after the new KEK was made and one key re-sealed.
        let old = HostKek::read(&s.kek).unwrap();
        let new = HostKek::create_or_read_file(&next_kek_path(&s.kek)).unwrap();
        let key: DiskKey = old
            .unwrap("a", &fs::read(s.keys.join("a.wrapped")).unwrap())
            .unwrap();
        write_private_atomic(&s.keys.join("a.wrapped"), &new.wrap("a", &key).unwrap()).unwrap();

        let err = HostKek::load(&KekSource::File(s.kek.clone())).unwrap_err();
        assert!(matches!(err, KeyError::RotationInterrupted(_)), "{err}");

        let report = rotate_kek(&s.kek, &s.keys).unwrap();
        assert_eq!((report.rewrapped, report.already_rewrapped), (1, 1));
        assert_eq!(report.new_kek_id, new.id_hex());
        let after = store(&s);
        assert_eq!(after.unwrap("a").unwrap().expose(), &created[0]);
        assert_eq!(after.unwrap("b").unwrap().expose(), &created[1]);
    }

    #[test]
    fn tampered_blob_stops_rotation_with_the_old_kek_still_in_place() {
        let (s, _) = setup(&["a"]);
        let path = s.keys.join("a.wrapped");
        let mut blob = fs::read(&path).unwrap();
        blob[40] ^= 1;
        write_private_atomic(&path, &blob).unwrap();
        let old_id = HostKek::read(&s.kek).unwrap().id_hex();
        let err = rotate_kek(&s.kek, &s.keys).unwrap_err();
        assert!(matches!(err, KeyError::Unauthentic(_)), "{err}");
        assert_eq!(HostKek::read(&s.kek).unwrap().id_hex(), old_id);
    }

    #[test]
    fn rotation_reseals_the_vgpu_licences_too() {
        let (s, _) = setup(&["a"]);
        store(&s).store_licence("a", b"licence-token").unwrap();
        let report = rotate_kek(&s.kek, &s.keys).unwrap();
        assert_eq!(report.rewrapped, 2);
        let after = store(&s);
        assert_eq!(
            after.licence("a").unwrap().unwrap().as_slice(),
            b"licence-token"
        );
        // Another rotation seals both again, under yet another KEK.
        let again = rotate_kek(&s.kek, &s.keys).unwrap();
        assert_eq!(again.rewrapped, 2);
        assert_eq!(
            store(&s).licence("a").unwrap().unwrap().as_slice(),
            b"licence-token"
        );
    }

    #[test]
    fn rotation_without_a_kek_is_an_error_not_a_fresh_key() {
        let dir = tempfile::tempdir().unwrap();
        let err = rotate_kek(&dir.path().join("missing"), dir.path()).unwrap_err();
        assert!(matches!(err, KeyError::KekFile(_)), "{err}");
        assert!(!dir.path().join("missing").exists());
    }
}
