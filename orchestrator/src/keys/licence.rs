//! A tenant's NVIDIA vGPU licence token at rest: sealed under the host KEK like its disk
//! key (its own magic and associated-data label, the tenant bound in), in
//! `<key dir>/<tenant>.licence`, mode 0600. The plaintext exists only in memory: taken out
//! of the create request, sealed, and unsealed again only to be handed to the guest agent
//! (`deliver-licence`); departure's crypto-shred overwrites and removes the sealed file.

use std::io;

use zeroize::Zeroizing;

use super::{
    create_private_dir, read_private, write_private_atomic, KeyError, KeyStore, PrivateFileError,
    SealKind, SEAL_OVERHEAD,
};

/// Longest token accepted (the guest protocol's cap).
pub const MAX_LICENCE_BYTES: usize = tenantvm_agent_protocol::MAX_LICENCE_LEN;
/// File suffix of a sealed licence in the key directory.
pub const LICENCE_SUFFIX: &str = ".licence";

/// A tenant's vGPU licence token.
pub(crate) const LICENCE_SEAL: SealKind = SealKind {
    magic: b"TVMLT1\0\0",
    label: b"tenantvm vgpu licence v1\0",
};

impl KeyStore {
    fn licence_path(&self, tenant: &str) -> Result<std::path::PathBuf, KeyError> {
        super::check_tenant_id(tenant)?;
        Ok(self.dir.join(format!("{tenant}{LICENCE_SUFFIX}")))
    }

    /// Seals `token` for `tenant` and stores it, replacing one stored before.
    pub fn store_licence(&self, tenant: &str, token: &[u8]) -> Result<(), KeyError> {
        let path = self.licence_path(tenant)?;
        let blob = self.kek.seal(&LICENCE_SEAL, tenant, token)?;
        create_private_dir(&self.dir)
            .and_then(|()| write_private_atomic(&path, &blob))
            .map_err(|source| KeyError::Io {
                action: "write",
                path: path.display().to_string(),
                source,
            })
    }

    /// The tenant's licence token, unsealed (zeroized on drop), or `None` without one.
    pub fn licence(&self, tenant: &str) -> Result<Option<Zeroizing<Vec<u8>>>, KeyError> {
        let path = self.licence_path(tenant)?;
        let blob = match read_private(&path, (SEAL_OVERHEAD + MAX_LICENCE_BYTES) as u64 + 1) {
            Ok(blob) => blob,
            Err(PrivateFileError::Read { source, .. })
                if source.kind() == io::ErrorKind::NotFound =>
            {
                return Ok(None)
            }
            Err(e) => return Err(e.into()),
        };
        Ok(Some(Zeroizing::new(self.kek.open(
            &LICENCE_SEAL,
            tenant,
            &blob,
        )?)))
    }

    /// Whether `tenant` has a sealed licence token.
    pub fn has_licence(&self, tenant: &str) -> Result<bool, KeyError> {
        Ok(self.licence_path(tenant)?.exists())
    }

    /// Destroys the tenant's sealed licence token (overwritten with zeroes, synced,
    /// unlinked, the directory synced). Returns whether there was one; idempotent.
    pub fn delete_licence(&self, tenant: &str) -> Result<bool, KeyError> {
        let path = self.licence_path(tenant)?;
        self.shred_file(&path)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::keys::{HostKek, KekSource};

    const TOKEN: &[u8] = b"eyJ0eXAiOiJKV1QifQ.licence-plaintext-7e2a.sig\n";

    fn store() -> (tempfile::TempDir, KeyStore) {
        let dir = tempfile::tempdir().unwrap();
        let kek = HostKek::load(&KekSource::File(dir.path().join("kek"))).unwrap();
        let store = KeyStore::new(&dir.path().join("keys"), kek).unwrap();
        (dir, store)
    }

    fn contains(hay: &[u8], needle: &[u8]) -> bool {
        hay.windows(needle.len()).any(|w| w == needle)
    }

    #[test]
    fn a_licence_is_sealed_at_rest_and_opens_for_its_tenant_only() {
        let (_dir, store) = store();
        assert_eq!(store.licence("alice").unwrap(), None);
        store.store_licence("alice", TOKEN).unwrap();
        let path = store.licence_path("alice").unwrap();
        let on_disk = std::fs::read(&path).unwrap();
        assert!(
            !contains(&on_disk, b"licence-plaintext"),
            "plaintext at rest"
        );
        assert_eq!(on_disk.len(), SEAL_OVERHEAD + TOKEN.len());
        use std::os::unix::fs::PermissionsExt;
        assert_eq!(
            std::fs::metadata(&path).unwrap().permissions().mode() & 0o777,
            0o600
        );
        assert_eq!(store.licence("alice").unwrap().unwrap().as_slice(), TOKEN);
        // Alice's blob under bob's name does not open.
        std::fs::copy(&path, store.licence_path("bob").unwrap()).unwrap();
        let err = store.licence("bob").unwrap_err();
        assert!(matches!(err, KeyError::Unauthentic(_)), "{err}");
        assert!(!format!("{err} {err:?}").contains("licence-plaintext"));
    }

    #[test]
    fn a_disk_key_blob_never_opens_as_a_licence_nor_the_other_way() {
        let (_dir, store) = store();
        store.create("alice").unwrap();
        std::fs::copy(
            store.path("alice").unwrap(),
            store.licence_path("alice").unwrap(),
        )
        .unwrap();
        assert!(matches!(
            store.licence("alice"),
            Err(KeyError::Malformed { .. })
        ));
        store.store_licence("carol", &[7u8; 64]).unwrap();
        std::fs::copy(
            store.licence_path("carol").unwrap(),
            store.path("carol").unwrap(),
        )
        .unwrap();
        store.unwrap("carol").unwrap_err();
    }

    #[test]
    fn deleting_a_licence_shreds_it_once() {
        let (_dir, store) = store();
        store.store_licence("alice", TOKEN).unwrap();
        assert!(store.has_licence("alice").unwrap());
        assert!(store.delete_licence("alice").unwrap());
        assert!(!store.has_licence("alice").unwrap());
        assert_eq!(store.licence("alice").unwrap(), None);
        assert!(!store.delete_licence("alice").unwrap());
        // The disk key's file is another file: untouched by the licence's deletion.
        store.create("alice").unwrap();
        store.delete_licence("alice").unwrap();
        assert!(store.exists("alice").unwrap());
    }
}
