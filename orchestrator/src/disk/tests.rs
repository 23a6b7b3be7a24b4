use std::fs;
use std::os::unix::fs::MetadataExt;
use std::process::Command;

use super::*;
use crate::keys::{write_private_atomic, DiskKey};

const SIZE: u64 = 20 << 20;

fn cryptsetup_available() -> bool {
    let found = Command::new("cryptsetup").arg("--version").output().is_ok();
    if !found {
        tenantvm_skip::record_skip!(
            "the cryptsetup tool is absent (apt-get install cryptsetup-bin)"
        );
    }
    found
}

/// `cryptsetup open --test-passphrase --key-file` with `key`: does the stock tool accept it?
fn stock_tool_opens(image: &Path, key: &DiskKey) -> bool {
    let dir = tempfile::tempdir().unwrap();
    let key_file = dir.path().join("key");
    write_private_atomic(&key_file, key.expose()).unwrap();
    Command::new("cryptsetup")
        .args(["open", "--test-passphrase", "--key-file"])
        .arg(&key_file)
        .arg(image)
        .status()
        .unwrap()
        .success()
}

fn luks_dump(image: &Path) -> Option<String> {
    let out = Command::new("cryptsetup")
        .arg("luksDump")
        .arg(image)
        .output()
        .unwrap();
    out.status
        .success()
        .then(|| String::from_utf8_lossy(&out.stdout).into_owned())
}

fn new_image(size: u64) -> (tempfile::TempDir, PathBuf, DiskKey) {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("tenant.img");
    let key = DiskKey::random().unwrap();
    create_image(&path, size, &key, KeyslotCost::TEST).unwrap();
    (dir, path, key)
}

#[test]
fn created_image_has_the_required_luks2_format() {
    let (_dir, path, _key) = new_image(SIZE);
    let info = info(&path).unwrap();
    assert_eq!(info.cipher, "aes-xts-plain64");
    assert_eq!(info.volume_key_bits, 512);
    assert_eq!(info.sector_bytes, 4096);
    assert_eq!(info.data_offset_bytes, HEADER_BYTES);
    assert_eq!(info.image_bytes, SIZE);
    assert_eq!(info.keyslots, vec![0]);
    if !cryptsetup_available() {
        return;
    }
    let dump = luks_dump(&path).expect("stock cryptsetup reads the header");
    assert!(dump.contains("Version:       \t2"), "{dump}");
    assert!(dump.contains("PBKDF:      argon2id"), "{dump}");
    assert!(dump.contains("sector: 4096 [bytes]"), "{dump}");
    assert!(dump.contains("cipher: aes-xts-plain64"), "{dump}");
}

#[test]
fn stock_cryptsetup_opens_with_the_tenant_key_only() {
    let (_dir, path, key) = new_image(SIZE);
    assert!(key_opens(&path, &key).unwrap());
    let other = DiskKey::random().unwrap();
    assert!(!key_opens(&path, &other).unwrap());
    if !cryptsetup_available() {
        return;
    }
    assert!(stock_tool_opens(&path, &key));
    assert!(!stock_tool_opens(&path, &other));
}

#[test]
fn image_is_sparse() {
    let (_dir, path, _key) = new_image(1 << 30);
    let meta = fs::metadata(&path).unwrap();
    assert_eq!(meta.len(), 1 << 30);
    // Only the header (16 MiB) may be allocated, plus filesystem slack.
    assert!(
        meta.blocks() * 512 <= HEADER_BYTES + (1 << 20),
        "{} bytes allocated",
        meta.blocks() * 512
    );
}

#[test]
fn create_again_with_the_same_key_keeps_the_image() {
    let (_dir, path, key) = new_image(SIZE);
    let first = info(&path).unwrap();
    let again = create_image(&path, SIZE, &key, KeyslotCost::TEST).unwrap();
    assert_eq!(first.uuid, again.uuid);
}

#[test]
fn create_refuses_to_reformat_an_image_of_another_key() {
    let (_dir, path, _key) = new_image(SIZE);
    let other = DiskKey::random().unwrap();
    let err = create_image(&path, SIZE, &other, KeyslotCost::TEST).unwrap_err();
    assert!(matches!(err, DiskError::ForeignImage(_)), "{err}");
}

#[test]
fn create_formats_a_file_left_without_header_by_a_crash() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("tenant.img");
    fs::write(&path, b"half-written").unwrap();
    let key = DiskKey::random().unwrap();
    create_image(&path, SIZE, &key, KeyslotCost::TEST).unwrap();
    assert!(key_opens(&path, &key).unwrap());
}

#[test]
fn bad_sizes_and_costs_are_refused() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("tenant.img");
    let key = DiskKey::random().unwrap();
    for size in [0, MIN_IMAGE_BYTES - 4096, MIN_IMAGE_BYTES + 512] {
        let err = create_image(&path, size, &key, KeyslotCost::TEST).unwrap_err();
        assert!(matches!(err, DiskError::BadSize { .. }), "{err}");
    }
    let cheap = KeyslotCost {
        iterations: 1,
        ..KeyslotCost::TEST
    };
    let err = create_image(&path, SIZE, &key, cheap).unwrap_err();
    assert!(matches!(err, DiskError::BadCost(_)), "{err}");
    assert!(!path.exists());
}

#[test]
fn info_of_a_plain_file_says_not_luks() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("plain");
    fs::write(&path, vec![0u8; 1 << 20]).unwrap();
    assert!(matches!(info(&path), Err(DiskError::NotLuks(_))));
}

#[test]
fn shred_destroys_the_header_so_the_old_key_no_longer_opens() {
    let (dir, path, key) = new_image(SIZE);
    // A second name for the inode lets the test inspect the bytes after the unlink.
    let witness = dir.path().join("witness");
    fs::hard_link(&path, &witness).unwrap();

    let report = shred_image(&path, Some(&key)).unwrap();

    assert_eq!(report.header_bytes_overwritten, HEADER_BYTES);
    assert!(report.header_overwrite_verified);
    assert_eq!(report.old_key_rejected, Some(true));
    assert!(report.deleted && !path.exists());
    assert_ne!(report.header_sha256_before, report.header_sha256_after);
    assert!(!key_opens(&witness, &key).unwrap());
    assert!(matches!(info(&witness), Err(DiskError::NotLuks(_))));
    let bytes = fs::read(&witness).unwrap();
    assert!(!bytes
        .windows(6)
        .any(|w| w == b"LUKS\xba\xbe" || w == b"SKUL\xba\xbe"));
    if report.bytes_discarded > 0 {
        assert!(
            bytes.iter().all(|&b| b == 0),
            "discarded image still holds data"
        );
    }
    if cryptsetup_available() {
        assert!(luks_dump(&witness).is_none());
        assert!(!stock_tool_opens(&witness, &key));
    }
}

#[test]
fn shred_again_reports_already_gone() {
    let (_dir, path, key) = new_image(SIZE);
    shred_image(&path, Some(&key)).unwrap();
    let again = shred_image(&path, Some(&key)).unwrap();
    assert!(again.already_gone);
}

#[test]
fn shred_of_an_image_whose_keyslot_is_already_gone_still_completes() {
    let (_dir, path, key) = new_image(SIZE);
    let mut dev = load_luks2(&path).unwrap().unwrap();
    dev.keyslot_handle().destroy(0).unwrap();
    drop(dev);

    let report = shred_image(&path, Some(&key)).unwrap();
    assert!(report.header_overwrite_verified && report.deleted);
    assert_eq!(report.old_key_rejected, Some(true));
}

#[test]
fn shred_resumes_after_a_crash_after_the_overwrite() {
    let (_dir, path, key) = new_image(SIZE);
    let witness = path.with_extension("witness");
    fs::hard_link(&path, &witness).unwrap();
    shred_image(&path, Some(&key)).unwrap();
    // The witness now looks like an image whose header was overwritten but never deleted.
    let report = shred_image(&witness, None).unwrap();
    assert_eq!(report.old_key_rejected, None);
    assert!(report.deleted && !witness.exists());
}

fn key_store(dir: &Path) -> crate::keys::KeyStore {
    use crate::keys::{HostKek, KekSource, KeyStore};
    let kek = HostKek::load(&KekSource::File(dir.join("kek"))).unwrap();
    KeyStore::new(&dir.join("keys"), kek).unwrap()
}

#[test]
fn crypto_shred_removes_header_wrapped_key_and_image() {
    let dir = tempfile::tempdir().unwrap();
    let keys = key_store(dir.path());
    let image = dir.path().join("alice.img");
    let key = keys.create("alice").unwrap();
    create_image(&image, SIZE, &key, KeyslotCost::TEST).unwrap();
    let witness = dir.path().join("witness");
    fs::hard_link(&image, &witness).unwrap();

    let report = crypto_shred(&keys, "alice", &image).unwrap();

    assert_eq!(report.image.old_key_rejected, Some(true));
    assert!(report.wrapped_key_deleted && report.wrapped_key_absent);
    assert!(report.image.deleted && !image.exists());
    assert!(!keys.exists("alice").unwrap());
    assert!(!key_opens(&witness, &key).unwrap());

    let record = report.step_record("t0".into(), "t1".into());
    assert_eq!(record.assurance, crate::receipt::Assurance::Verified);
    assert_eq!(record.evidence["old_key_rejected"], "true");
    assert_eq!(
        record.evidence["header_bytes_overwritten"],
        HEADER_BYTES.to_string()
    );
}

#[test]
fn crypto_shred_resumes_after_the_wrapped_key_was_deleted() {
    let dir = tempfile::tempdir().unwrap();
    let keys = key_store(dir.path());
    let image = dir.path().join("alice.img");
    let key = keys.create("alice").unwrap();
    create_image(&image, SIZE, &key, KeyslotCost::TEST).unwrap();
    // A crash after the header was destroyed and the key deleted, before the discard.
    destroy_header(&image, Some(&key)).unwrap();
    keys.delete("alice").unwrap();

    let report = crypto_shred(&keys, "alice", &image).unwrap();
    assert_eq!(report.image.old_key_rejected, None);
    assert!(!report.wrapped_key_deleted && report.wrapped_key_absent);
    assert!(report.image.deleted && !image.exists());

    let again = crypto_shred(&keys, "alice", &image).unwrap();
    assert!(again.image.already_gone);
}
