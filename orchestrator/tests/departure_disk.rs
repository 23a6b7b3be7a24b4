//! A tenant's encrypted disk through the real daemon (QEMU backend under TCG, the idle guest; KVM-in-QEMU fails on nested hosts like the build VM):
//! create makes a LUKS2 image the stock `cryptsetup` accepts, owned by the tenant's uid and
//! opened by its key, which is stored only wrapped; after `tenantvm destroy` the old key no
//! longer opens the header, the wrapped key is gone, the image is gone, and the receipt
//! records a verified crypto-shred. tenantvm-vmm attaches the image as virtio-blk. Skips
//! without root, /dev/kvm or QEMU.

mod support;

use std::os::unix::fs::MetadataExt;
use std::process::Command;

use support::daemon::{self, TestDaemon};
use support::departure::{cli, create, image, keys, ok, text};
use tenantvm::disk::key_opens;
use tenantvm::receipt::{Assurance, DepartureStep, StepResult};

#[test]
fn destroy_crypto_shreds_the_tenant_disk() {
    if daemon::should_skip("destroy_crypto_shreds_the_tenant_disk") {
        return;
    }
    if let Some(why) = support::departure::qemu_skip() {
        tenantvm_skip::skip!("{why}");
    }
    let mut d = TestDaemon::new().with_args(&["--backend", "qemu-tcg"]);
    d.start(None);
    let name = daemon::unique("dsk");
    ok(
        support::departure::create_qemu(&d, &name, "disk_gib = 1"),
        "create",
        &d,
    );
    let img = image(&d, &name);
    let meta = std::fs::metadata(&img).unwrap();
    assert_eq!(meta.len(), 1 << 30);
    assert!(meta.blocks() * 512 < 64 << 20, "image is not sparse");
    assert_eq!(meta.mode() & 0o777, 0o600);
    let owner_uid = d
        .store()
        .resources(None)
        .unwrap()
        .into_iter()
        .find(|r| r.kind == tenantvm::store::ResourceKind::Uid)
        .unwrap()
        .key
        .parse::<u32>()
        .unwrap();
    assert_eq!(meta.uid(), owner_uid, "the VMM's uid must own the image");

    let store = keys(&d);
    let key = store.unwrap(&name).unwrap();
    assert!(key_opens(&img, &key).unwrap());
    // The stock tool agrees.
    let keyfile = d.dir.path().join("key.bin");
    std::fs::write(&keyfile, key.expose()).unwrap();
    let dump = Command::new("cryptsetup")
        .args(["luksDump", img.to_str().unwrap()])
        .output();
    if let Ok(dump) = dump {
        let out = text(&dump);
        assert!(
            out.contains("Version:       \t2") || out.contains("LUKS header information"),
            "{out}"
        );
        assert!(out.contains("argon2id"), "{out}");
        let open = Command::new("cryptsetup")
            .args(["open", "--test-passphrase", "--key-file"])
            .arg(&keyfile)
            .arg(&img)
            .status()
            .unwrap();
        assert!(open.success(), "cryptsetup refused the tenant key");
    } else {
        tenantvm_skip::record_skip!(
            "the stock-tool checks need cryptsetup (apt-get install cryptsetup-bin)"
        );
    }
    let keep = d.dir.path().join("image-link");
    std::fs::hard_link(&img, &keep).unwrap();

    ok(cli(&d, None, &["destroy", &name]), "destroy", &d);
    assert!(!img.exists(), "image left");
    assert!(!store.exists(&name).unwrap(), "wrapped key left");
    assert!(
        !key_opens(&keep, &key).unwrap(),
        "the old key still opens the header"
    );
    if Command::new("cryptsetup").arg("--version").output().is_ok() {
        let open = Command::new("cryptsetup")
            .args(["open", "--test-passphrase", "--key-file"])
            .arg(&keyfile)
            .arg(&keep)
            .output()
            .unwrap();
        assert!(
            !open.status.success(),
            "cryptsetup still opens the shredded header"
        );
    }

    let entries = support::departure::receipts_of(&d, &name);
    assert_eq!(entries.len(), 1);
    let shred = entries[0]
        .receipt
        .steps
        .iter()
        .find(|s| s.step == DepartureStep::CryptoShred)
        .unwrap();
    assert_eq!(shred.result, StepResult::Ok);
    assert_eq!(shred.assurance, Assurance::Verified);
    assert_eq!(shred.evidence["old_key_rejected"], "true");
    // The CLI shows it.
    let shown = ok(
        cli(&d, None, &["receipt", "show", &name]),
        "receipt show",
        &d,
    );
    assert!(text(&shown).contains("crypto-shred"), "{}", text(&shown));
    d.stop();
}

#[test]
fn the_vmm_backend_attaches_the_encrypted_disk_as_virtio_blk() {
    if daemon::should_skip("the_vmm_backend_attaches_the_encrypted_disk_as_virtio_blk") {
        return;
    }
    let mut d = TestDaemon::new();
    d.start(None);
    let name = daemon::unique("vbd");
    ok(create(&d, &name, "disk_gib = 1"), "create", &d);
    let img = image(&d, &name);
    assert!(key_opens(&img, &keys(&d).unwrap(&name).unwrap()).unwrap());
    // The jailed VMM got the image as its first virtio-blk disk, read-write: its config
    // file, read where the VMM itself reads it (inside its jail).
    let vmms: Vec<i32> = daemon::processes_in_cgroup_of(&name)
        .into_iter()
        .filter(|pid| {
            std::fs::read(format!("/proc/{pid}/cmdline")).is_ok_and(|raw| {
                raw.split(|b| *b == 0)
                    .next()
                    .is_some_and(|prog| prog.ends_with(b"/tenantvm-vmm"))
            })
        })
        .collect();
    assert_eq!(vmms.len(), 1, "one VMM in the tenant's cgroup: {vmms:?}");
    let cmdline = std::fs::read(format!("/proc/{}/cmdline", vmms[0])).unwrap();
    assert!(
        String::from_utf8_lossy(&cmdline).contains("--config\0/vm/config.json"),
        "{}",
        String::from_utf8_lossy(&cmdline)
    );
    let text = std::fs::read_to_string(format!("/proc/{}/root/vm/config.json", vmms[0])).unwrap();
    let config = tenantvm_vmm_api::VmConfigFile::from_json(&text).unwrap();
    let disks = config.disks.expect("a disk in the VMM's config");
    assert_eq!(disks.len(), 1, "{text}");
    assert_eq!(
        disks[0].path,
        std::path::PathBuf::from("/vm/disk0"),
        "{text}"
    );
    assert_eq!(disks[0].id.as_deref(), Some("disk0"), "{text}");
    assert!(!disks[0].read_only, "{text}");
    ok(cli(&d, None, &["destroy", &name]), "destroy", &d);
    assert!(!img.exists(), "the image outlived destroy");
    d.stop();
}
