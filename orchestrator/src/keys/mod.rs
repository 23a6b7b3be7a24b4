//! Tenant disk keys and the host key-encryption key (KEK).
//!
//! Every tenant disk has its own random 512-bit key. It is stored only wrapped: sealed with
//! AES-256-GCM under the host KEK, with the tenant id bound in as associated data, so a blob
//! copied to another tenant's name does not open. The KEK is 32 random bytes in a root-only
//! file created at daemon initialisation, or a systemd credential. Unwrapped keys exist only in
//! memory, inside [`Secret`] (zeroized on drop, never printed); no error message carries key
//! bytes. A tenant's vGPU licence token is sealed the same way, in a file of its own
//! ([`KeyStore::store_licence`]).

mod files;
mod licence;
mod rotate;
mod secret;

use std::fs::{self, OpenOptions};
use std::io::{self, Write};
use std::path::{Path, PathBuf};

use aes_gcm::aead::{Aead, KeyInit, Payload};
use aes_gcm::{Aes256Gcm, Nonce};
use sha2::{Digest, Sha256};
use zeroize::Zeroize;

use crate::domain::TenantName;

pub use files::{check_secret_path, write_secret, Existing, PrivateFileError};
pub(crate) use files::{
    create_private_dir, create_private_new, read_private, sync_dir, write_private_atomic,
    write_public,
};
pub use licence::{LICENCE_SUFFIX, MAX_LICENCE_BYTES};
pub use rotate::{next_kek_path, rotate_kek, RotationReport};
pub use secret::Secret;

/// Bytes in a tenant disk key (512 bits: the LUKS2 keyslot passphrase the guest opens with).
pub const DISK_KEY_BYTES: usize = 64;
/// Bytes in the host key-encryption key (AES-256).
pub const KEK_BYTES: usize = 32;
/// Default host KEK file: outside the state directory, so a backup of the state (wrapped
/// keys) does not carry the key that opens it.
pub const DEFAULT_KEK_FILE: &str = "/etc/tenantvm/host-kek";
/// Default directory of the wrapped tenant keys.
pub const DEFAULT_KEY_DIR: &str = "/var/lib/tenantvm/keys";
/// The systemd credential name the daemon looks for in `$CREDENTIALS_DIRECTORY`.
pub const KEK_CREDENTIAL: &str = "tenantvm-kek";

/// A tenant's disk key, unwrapped. Only in memory; zeroized on drop.
pub type DiskKey = Secret<DISK_KEY_BYTES>;

const WRAP_MAGIC: &[u8; 8] = b"TVMWK1\0\0";
const KEK_ID_BYTES: usize = 8;
const NONCE_BYTES: usize = 12;
const TAG_BYTES: usize = 16;
/// Size of a wrapped key file: magic, KEK id, nonce, ciphertext and tag.
pub const WRAPPED_BYTES: usize = 8 + KEK_ID_BYTES + NONCE_BYTES + DISK_KEY_BYTES + TAG_BYTES;
const AAD_PREFIX: &[u8] = b"tenantvm disk key v1\0";

/// Errors of the key store. None of them carries key material.
#[derive(Debug, thiserror::Error)]
pub enum KeyError {
    /// A tenant id that cannot name a key file.
    #[error("Invalid tenant name {0:?}: use 1-63 characters from a-z, 0-9 and '-', starting with a letter or digit")]
    InvalidTenantId(String),
    /// The host KEK file or credential was refused.
    #[error("Host key-encryption key refused: {0}")]
    KekFile(#[from] PrivateFileError),
    /// The host KEK has the wrong length.
    #[error("Host key-encryption key at {path} holds {len} bytes, expected {KEK_BYTES}; restore the right file (a new one cannot open existing disks)")]
    KekLength {
        /// Where it was read from.
        path: String,
        /// How many bytes it held.
        len: usize,
    },
    /// `$CREDENTIALS_DIRECTORY` names no KEK credential.
    #[error("No systemd credential {name} in {dir}; add LoadCredential={name}:<path> to the unit")]
    NoCredential {
        /// The credentials directory.
        dir: String,
        /// The credential looked for.
        name: String,
    },
    /// The operating system's random number generator failed.
    #[error("The system random number generator failed: {0}")]
    Random(String),
    /// A KEK rotation was interrupted; starting with either KEK alone would strand keys.
    #[error("A rotation of the host key-encryption key {0} was interrupted; finish it (run the rotation again) before starting the daemon")]
    RotationInterrupted(String),
    /// AES-GCM refused to seal (it only does so for inputs far larger than a key).
    #[error("Sealing the disk key of tenant {0} failed")]
    Seal(String),
    /// A key file could not be read, written or removed.
    #[error("Cannot {action} {path}: {source}")]
    Io {
        /// What was being done.
        action: &'static str,
        /// The file.
        path: String,
        /// The I/O error.
        source: io::Error,
    },
    /// No wrapped key for this tenant.
    #[error("No disk key for tenant {0}; it was never created or has been destroyed")]
    NotFound(String),
    /// The blob is not a wrapped key of this version.
    #[error("The wrapped key for tenant {tenant} is malformed ({reason}); restore it from backup")]
    Malformed {
        /// The tenant.
        tenant: String,
        /// What is wrong with it.
        reason: &'static str,
    },
    /// The blob was wrapped under another host KEK.
    #[error("The wrapped key for tenant {0} was sealed under a different host key-encryption key; start the daemon with the KEK it was created with")]
    WrongKek(String),
    /// Authentication failed: tampered blob, or a blob that belongs to another tenant.
    #[error("The wrapped key for tenant {0} failed authentication: it was altered or belongs to another tenant")]
    Unauthentic(String),
}

/// Checks that `tenant` is a tenant name ([`TenantName`]'s rule, the one every layer uses),
/// which makes it safe as a file name and as associated data.
pub fn check_tenant_id(tenant: &str) -> Result<(), KeyError> {
    TenantName::check(tenant).map_err(|e| KeyError::InvalidTenantId(e.0))
}

fn random_error(e: impl std::fmt::Display) -> KeyError {
    KeyError::Random(e.to_string())
}

/// Where the host KEK comes from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum KekSource {
    /// A root-only file, created with fresh random bytes if absent.
    File(PathBuf),
    /// A systemd credential (`LoadCredential=`/`SetCredentialEncrypted=`), never created.
    Credential {
        /// `$CREDENTIALS_DIRECTORY`.
        dir: PathBuf,
        /// The credential's name.
        name: String,
    },
}

impl KekSource {
    /// The systemd credential when the daemon runs with `$CREDENTIALS_DIRECTORY` holding
    /// [`KEK_CREDENTIAL`], otherwise the file `default_file`.
    pub fn detect(default_file: &Path) -> Self {
        if let Some(dir) = std::env::var_os("CREDENTIALS_DIRECTORY") {
            let dir = PathBuf::from(dir);
            if dir.join(KEK_CREDENTIAL).exists() {
                return KekSource::Credential {
                    dir,
                    name: KEK_CREDENTIAL.to_string(),
                };
            }
        }
        KekSource::File(default_file.to_path_buf())
    }
}

/// The host key-encryption key.
#[derive(Debug)]
pub struct HostKek {
    key: Secret<KEK_BYTES>,
    id: [u8; KEK_ID_BYTES],
}

impl HostKek {
    /// Loads the KEK from `source`; a missing KEK file is created (mode 0600) with fresh random
    /// bytes, which is what daemon initialisation does on a new host.
    pub fn load(source: &KekSource) -> Result<Self, KeyError> {
        match source {
            KekSource::File(path) => Self::load_or_create_file(path),
            KekSource::Credential { dir, name } => {
                let path = dir.join(name);
                if !path.exists() {
                    return Err(KeyError::NoCredential {
                        dir: dir.display().to_string(),
                        name: name.clone(),
                    });
                }
                Self::read(&path)
            }
        }
    }

    fn load_or_create_file(path: &Path) -> Result<Self, KeyError> {
        if next_kek_path(path).exists() {
            return Err(KeyError::RotationInterrupted(path.display().to_string()));
        }
        Self::create_or_read_file(path)
    }

    /// Reads the KEK file at `path`, creating it with fresh random bytes if absent.
    fn create_or_read_file(path: &Path) -> Result<Self, KeyError> {
        if path.exists() {
            return Self::read(path);
        }
        let key = Secret::<KEK_BYTES>::random().map_err(random_error)?;
        let dir = path.parent().unwrap_or(Path::new("."));
        let io_err = |action, source| KeyError::Io {
            action,
            path: path.display().to_string(),
            source,
        };
        create_private_dir(dir).map_err(|e| io_err("create the directory of", e))?;
        // Kept if it exists: two daemons initialising at once must not end up with different
        // KEKs, and a crash never leaves a torn one.
        if create_private_new(path, key.expose()).map_err(|e| io_err("create", e))? {
            Ok(Self::from_secret(key))
        } else {
            Self::read(path)
        }
    }

    fn read(path: &Path) -> Result<Self, KeyError> {
        let mut bytes = read_private(path, KEK_BYTES as u64 + 1)?;
        let key = Secret::<KEK_BYTES>::from_slice(&bytes);
        let len = bytes.len();
        bytes.zeroize();
        key.map(Self::from_secret).ok_or(KeyError::KekLength {
            path: path.display().to_string(),
            len,
        })
    }

    fn from_secret(key: Secret<KEK_BYTES>) -> Self {
        let digest = Sha256::new()
            .chain_update(b"tenantvm kek id v1\0")
            .chain_update(key.expose())
            .finalize();
        let mut id = [0u8; KEK_ID_BYTES];
        id.copy_from_slice(&digest[..KEK_ID_BYTES]);
        HostKek { key, id }
    }

    /// A short public identifier of this KEK (a hash prefix, safe to log).
    pub fn id_hex(&self) -> String {
        hex::encode(self.id)
    }

    /// Seals `key` for `tenant`: the result is safe to store, and opens only under this KEK and
    /// with the same tenant id.
    pub fn wrap(&self, tenant: &str, key: &DiskKey) -> Result<Vec<u8>, KeyError> {
        self.seal(&DISK_KEY_SEAL, tenant, key.expose())
    }

    /// Opens a blob made by [`HostKek::wrap`] for the same `tenant`.
    pub fn unwrap(&self, tenant: &str, blob: &[u8]) -> Result<DiskKey, KeyError> {
        check_tenant_id(tenant)?;
        if blob.len() != WRAPPED_BYTES {
            return Err(KeyError::Malformed {
                tenant: tenant.to_string(),
                reason: "wrong length",
            });
        }
        let mut plain = self.open(&DISK_KEY_SEAL, tenant, blob)?;
        let key = DiskKey::from_slice(&plain);
        plain.zeroize();
        key.ok_or_else(|| KeyError::Malformed {
            tenant: tenant.to_string(),
            reason: "wrong key length",
        })
    }

    /// Seals `secret` for `tenant` as `kind` says: magic, KEK id, nonce, then the AES-GCM
    /// ciphertext and tag, with the kind's label and the tenant bound in as associated data
    /// (so one kind's blob never opens as another's, nor under another tenant's name).
    pub(crate) fn seal(
        &self,
        kind: &SealKind,
        tenant: &str,
        secret: &[u8],
    ) -> Result<Vec<u8>, KeyError> {
        use rand::TryRngCore;
        check_tenant_id(tenant)?;
        let mut nonce = [0u8; NONCE_BYTES];
        rand::rngs::OsRng
            .try_fill_bytes(&mut nonce)
            .map_err(random_error)?;
        let cipher = Aes256Gcm::new(self.key.expose().into());
        let aad = associated_data(kind, tenant);
        let sealed = cipher
            .encrypt(
                Nonce::from_slice(&nonce),
                Payload {
                    msg: secret,
                    aad: &aad,
                },
            )
            .map_err(|_| KeyError::Seal(tenant.to_string()))?;
        let mut blob = Vec::with_capacity(SEAL_OVERHEAD + secret.len());
        blob.extend_from_slice(kind.magic);
        blob.extend_from_slice(&self.id);
        blob.extend_from_slice(&nonce);
        blob.extend_from_slice(&sealed);
        Ok(blob)
    }

    /// Opens a blob made by [`HostKek::seal`] with the same `kind` and `tenant`; the
    /// plaintext is the caller's to zeroize.
    pub(crate) fn open(
        &self,
        kind: &SealKind,
        tenant: &str,
        blob: &[u8],
    ) -> Result<Vec<u8>, KeyError> {
        check_tenant_id(tenant)?;
        let malformed = |reason| KeyError::Malformed {
            tenant: tenant.to_string(),
            reason,
        };
        if blob.len() < SEAL_OVERHEAD {
            return Err(malformed("too short"));
        }
        let (magic, rest) = blob.split_at(kind.magic.len());
        if magic != kind.magic {
            return Err(malformed("unknown magic or version"));
        }
        let (id, rest) = rest.split_at(KEK_ID_BYTES);
        if id != self.id {
            return Err(KeyError::WrongKek(tenant.to_string()));
        }
        let (nonce, sealed) = rest.split_at(NONCE_BYTES);
        let cipher = Aes256Gcm::new(self.key.expose().into());
        let aad = associated_data(kind, tenant);
        cipher
            .decrypt(
                Nonce::from_slice(nonce),
                Payload {
                    msg: sealed,
                    aad: &aad,
                },
            )
            .map_err(|_| KeyError::Unauthentic(tenant.to_string()))
    }
}

/// What a sealed blob holds: its file magic and the label bound into its associated data.
#[derive(Debug)]
pub(crate) struct SealKind {
    magic: &'static [u8; 8],
    label: &'static [u8],
}

/// A tenant's disk key.
const DISK_KEY_SEAL: SealKind = SealKind {
    magic: WRAP_MAGIC,
    label: AAD_PREFIX,
};

/// Bytes a sealed blob adds to its secret: magic, KEK id, nonce and tag.
const SEAL_OVERHEAD: usize = 8 + KEK_ID_BYTES + NONCE_BYTES + TAG_BYTES;

fn associated_data(kind: &SealKind, tenant: &str) -> Vec<u8> {
    let mut aad = kind.label.to_vec();
    aad.extend_from_slice(tenant.as_bytes());
    aad
}

/// The wrapped disk keys of all tenants: one file per tenant in a root-only directory.
#[derive(Debug)]
pub struct KeyStore {
    dir: PathBuf,
    kek: HostKek,
}

impl KeyStore {
    /// A store in `dir` (created if absent) sealing under `kek`.
    pub fn new(dir: &Path, kek: HostKek) -> Result<Self, KeyError> {
        create_private_dir(dir).map_err(|source| KeyError::Io {
            action: "create",
            path: dir.display().to_string(),
            source,
        })?;
        Ok(KeyStore {
            dir: dir.to_path_buf(),
            kek,
        })
    }

    /// The file holding `tenant`'s wrapped key.
    pub fn path(&self, tenant: &str) -> Result<PathBuf, KeyError> {
        check_tenant_id(tenant)?;
        Ok(self.dir.join(format!("{tenant}.wrapped")))
    }

    /// Whether `tenant` has a wrapped key.
    pub fn exists(&self, tenant: &str) -> Result<bool, KeyError> {
        Ok(self.path(tenant)?.exists())
    }

    /// The tenant's disk key, generating and storing a new one if it has none. Idempotent: a
    /// create step re-run after a crash gets the key it stored the first time.
    pub fn create(&self, tenant: &str) -> Result<DiskKey, KeyError> {
        if self.exists(tenant)? {
            return self.unwrap(tenant);
        }
        let key = DiskKey::random().map_err(random_error)?;
        let blob = self.kek.wrap(tenant, &key)?;
        let path = self.path(tenant)?;
        let created = create_private_new(&path, &blob).map_err(|source| KeyError::Io {
            action: "write",
            path: path.display().to_string(),
            source,
        })?;
        if created {
            Ok(key)
        } else {
            // Another create for this tenant won the race: use its key, never replace it.
            self.unwrap(tenant)
        }
    }

    /// Unwraps the tenant's stored disk key.
    pub fn unwrap(&self, tenant: &str) -> Result<DiskKey, KeyError> {
        let path = self.path(tenant)?;
        let blob = match read_private(&path, WRAPPED_BYTES as u64 + 1) {
            Ok(blob) => blob,
            Err(PrivateFileError::Read { source, .. })
                if source.kind() == io::ErrorKind::NotFound =>
            {
                return Err(KeyError::NotFound(tenant.to_string()))
            }
            Err(e) => return Err(e.into()),
        };
        self.kek.unwrap(tenant, &blob)
    }

    /// Destroys the tenant's wrapped key: overwrites the file with zeroes, syncs, unlinks it and
    /// syncs the directory. Returns whether there was a key; idempotent.
    pub fn delete(&self, tenant: &str) -> Result<bool, KeyError> {
        let path = self.path(tenant)?;
        self.shred_file(&path)
    }

    /// Overwrites `path` (a file of this store) with zeroes, syncs, unlinks it and syncs the
    /// directory. Returns whether it existed; idempotent.
    fn shred_file(&self, path: &Path) -> Result<bool, KeyError> {
        let io_err = |action, source| KeyError::Io {
            action,
            path: path.display().to_string(),
            source,
        };
        match OpenOptions::new().write(true).open(path) {
            Ok(mut file) => {
                let len = file.metadata().map_err(|e| io_err("stat", e))?.len();
                let zeroes = vec![0u8; usize::try_from(len).unwrap_or(WRAPPED_BYTES)];
                file.write_all(&zeroes)
                    .and_then(|()| file.sync_all())
                    .map_err(|e| io_err("overwrite", e))?;
            }
            Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(false),
            Err(e) => return Err(io_err("open", e)),
        }
        fs::remove_file(path).map_err(|e| io_err("remove", e))?;
        sync_dir(&self.dir).map_err(|e| io_err("sync the directory of", e))?;
        Ok(true)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn store() -> (tempfile::TempDir, KeyStore) {
        let dir = tempfile::tempdir().unwrap();
        let kek = HostKek::load(&KekSource::File(dir.path().join("kek"))).unwrap();
        let store = KeyStore::new(&dir.path().join("keys"), kek).unwrap();
        (dir, store)
    }

    #[test]
    fn create_then_unwrap_returns_the_same_key() {
        let (_dir, store) = store();
        let created = store.create("alice").unwrap();
        let again = store.unwrap("alice").unwrap();
        assert_eq!(created.expose(), again.expose());
        // Re-running create (crash recovery) must not replace the key.
        assert_eq!(store.create("alice").unwrap().expose(), created.expose());
    }

    #[test]
    fn concurrent_creates_agree_on_one_key() {
        let (_dir, store) = store();
        let keys: Vec<[u8; DISK_KEY_BYTES]> = std::thread::scope(|s| {
            let handles: Vec<_> = (0..4)
                .map(|_| s.spawn(|| *store.create("racer").unwrap().expose()))
                .collect();
            handles.into_iter().map(|h| h.join().unwrap()).collect()
        });
        assert!(keys.windows(2).all(|w| w[0] == w[1]));
        assert_eq!(store.unwrap("racer").unwrap().expose(), &keys[0]);
    }

    #[test]
    fn kek_file_is_created_owner_only_and_reloaded() {
        use std::os::unix::fs::PermissionsExt;
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("etc").join("kek");
        let first = HostKek::load(&KekSource::File(path.clone())).unwrap();
        let mode = fs::metadata(&path).unwrap().permissions().mode() & 0o777;
        assert_eq!(mode, 0o600);
        let second = HostKek::load(&KekSource::File(path)).unwrap();
        assert_eq!(first.id_hex(), second.id_hex());
    }

    #[test]
    fn kek_of_wrong_length_is_refused() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("kek");
        write_private_atomic(&path, &[7u8; 16]).unwrap();
        let err = HostKek::load(&KekSource::File(path)).unwrap_err();
        assert!(matches!(err, KeyError::KekLength { len: 16, .. }), "{err}");
    }

    #[test]
    fn missing_credential_is_reported() {
        let dir = tempfile::tempdir().unwrap();
        let source = KekSource::Credential {
            dir: dir.path().to_path_buf(),
            name: KEK_CREDENTIAL.to_string(),
        };
        let err = HostKek::load(&source).unwrap_err();
        assert!(matches!(err, KeyError::NoCredential { .. }), "{err}");
    }

    #[test]
    fn credential_is_read_when_present() {
        let dir = tempfile::tempdir().unwrap();
        write_private_atomic(&dir.path().join(KEK_CREDENTIAL), &[3u8; KEK_BYTES]).unwrap();
        let source = KekSource::Credential {
            dir: dir.path().to_path_buf(),
            name: KEK_CREDENTIAL.to_string(),
        };
        let kek = HostKek::load(&source).unwrap();
        let key = DiskKey::random().unwrap();
        let blob = kek.wrap("t1", &key).unwrap();
        assert_eq!(kek.unwrap("t1", &blob).unwrap().expose(), key.expose());
    }

    #[test]
    fn unwrap_with_another_tenant_id_fails() {
        let (_dir, store) = store();
        let key = DiskKey::random().unwrap();
        let blob = store.kek.wrap("alice", &key).unwrap();
        // The blob of alice stored under bob's name, as a hostile rename would.
        write_private_atomic(&store.path("bob").unwrap(), &blob).unwrap();
        let err = store.unwrap("bob").unwrap_err();
        assert!(
            matches!(err, KeyError::Unauthentic(ref t) if t == "bob"),
            "{err}"
        );
    }

    #[test]
    fn every_tampered_byte_is_detected() {
        let (_dir, store) = store();
        let key = DiskKey::random().unwrap();
        let blob = store.kek.wrap("alice", &key).unwrap();
        for i in 0..blob.len() {
            let mut bad = blob.clone();
            bad[i] ^= 0x01;
            assert!(
                store.kek.unwrap("alice", &bad).is_err(),
                "byte {i} flip undetected"
            );
        }
        store
            .kek
            .unwrap("alice", &blob[..blob.len() - 1])
            .unwrap_err();
    }

    #[test]
    fn blob_from_another_kek_is_named_as_such() {
        let (_dir, a) = store();
        let (_dir2, b) = store();
        let key = DiskKey::random().unwrap();
        let blob = a.kek.wrap("alice", &key).unwrap();
        let err = b.kek.unwrap("alice", &blob).unwrap_err();
        assert!(matches!(err, KeyError::WrongKek(_)), "{err}");
    }

    #[test]
    fn errors_and_debug_never_show_key_bytes() {
        let (_dir, store) = store();
        let key = store.create("alice").unwrap();
        let hex_key = hex::encode(key.expose());
        let debug = format!("{store:?} {key:?}");
        assert!(!debug.contains(&hex_key[..16]));
        assert!(!debug.contains(&format!("{:?}", &key.expose()[..4])));
        let err = store.unwrap("bob").unwrap_err();
        assert!(!format!("{err} {err:?}").contains(&hex_key[..16]));
    }

    #[test]
    fn delete_removes_the_wrapped_key_and_is_idempotent() {
        let (_dir, store) = store();
        store.create("alice").unwrap();
        let path = store.path("alice").unwrap();
        assert!(store.delete("alice").unwrap());
        assert!(!path.exists());
        assert!(matches!(store.unwrap("alice"), Err(KeyError::NotFound(_))));
        assert!(!store.delete("alice").unwrap());
    }

    #[test]
    fn tenant_ids_that_could_escape_the_directory_are_refused() {
        let (_dir, store) = store();
        let long = "x".repeat(64);
        for bad in [
            "", "../etc", "a/b", "-x", ".hidden", &long, "é", "Alice", "a_b", "a\0",
        ] {
            assert!(
                matches!(store.create(bad), Err(KeyError::InvalidTenantId(_))),
                "{bad:?} accepted"
            );
        }
        store.create(&"x".repeat(63)).unwrap();
    }
}
