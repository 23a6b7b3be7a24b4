//! End to end: a real Linux guest (the stock Debian kernel under QEMU) opens a tenant disk
//! made by `tenantvm::disk` with dm-crypt, given the tenant key, writes a plaintext marker
//! through it, and the host checks that the marker never appears in the image file. Then the
//! disk is crypto-shredded.
//!
//! Needs root, `qemu-system-x86_64`, `busybox` (static), `cryptsetup`, `modinfo`, `cpio`, and
//! the kernel fetched by scripts/setup.sh (or TENANTVM_KERNEL_DIR naming such a directory); skips
//! with a printed reason when any is absent. In this test the key reaches the guest inside its
//! initramfs, standing in for the guest agent's control channel.

use std::collections::BTreeSet;
use std::fs;
use std::io::Read;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use tenantvm::disk::{create_image, crypto_shred, KeyslotCost, HEADER_BYTES};
use tenantvm::keys::{HostKek, KekSource, KeyStore};

const IMAGE_BYTES: u64 = 32 << 20;
const MARKER_BYTES: usize = 1 << 20;
const GUEST_TIMEOUT: Duration = Duration::from_secs(300);
// xts(aes) instantiates ecb(aes): both templates are modules in the Debian kernel.
const MODULES: &[&str] = &["virtio_pci", "virtio_blk", "dm-crypt", "xts", "ecb"];

fn kernel_dir() -> PathBuf {
    std::env::var_os("TENANTVM_KERNEL_DIR").map_or_else(
        || Path::new(env!("CARGO_MANIFEST_DIR")).join("../.cache/kernel"),
        PathBuf::from,
    )
}

fn missing_prerequisite() -> Option<String> {
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } != 0 {
        return Some("needs root (libcryptsetup locks memory)".into());
    }
    for tool in [
        "qemu-system-x86_64",
        "busybox",
        "cryptsetup",
        "modinfo",
        "cpio",
    ] {
        let found = Command::new("sh")
            .args(["-c", &format!("command -v {tool}")])
            .stdout(Stdio::null())
            .status()
            .is_ok_and(|s| s.success());
        if !found {
            return Some(format!("{tool} is not installed (scripts/setup.sh)"));
        }
    }
    let k = kernel_dir();
    if !k.join("vmlinuz").exists() || !k.join("modules").exists() {
        return Some(format!(
            "no kernel in {} (run scripts/setup.sh or set TENANTVM_KERNEL_DIR)",
            k.display()
        ));
    }
    None
}

/// Every `.ko` under `dir`, by module name with `-` and `_` unified.
fn index_modules(dir: &Path, out: &mut Vec<(String, PathBuf)>) {
    for entry in fs::read_dir(dir).unwrap() {
        let path = entry.unwrap().path();
        if path.is_dir() {
            index_modules(&path, out);
        } else if path.extension().is_some_and(|e| e == "ko") {
            let name = path
                .file_stem()
                .unwrap()
                .to_string_lossy()
                .replace('-', "_");
            out.push((name, path));
        }
    }
}

/// `wanted` and their dependencies, dependencies first.
fn modules_in_load_order(wanted: &[&str]) -> Vec<PathBuf> {
    let mut index = Vec::new();
    index_modules(&kernel_dir().join("modules"), &mut index);
    let find = |name: &str| {
        let name = name.replace('-', "_");
        index.iter().find(|(n, _)| *n == name).map_or_else(
            || panic!("module {name} not in the kernel's modules"),
            |(_, p)| p.clone(),
        )
    };
    fn visit(
        path: PathBuf,
        find: &dyn Fn(&str) -> PathBuf,
        seen: &mut BTreeSet<PathBuf>,
        order: &mut Vec<PathBuf>,
    ) {
        if !seen.insert(path.clone()) {
            return;
        }
        let out = Command::new("modinfo")
            .args(["-F", "depends"])
            .arg(&path)
            .output()
            .unwrap();
        for dep in String::from_utf8_lossy(&out.stdout)
            .trim()
            .split(',')
            .filter(|d| !d.is_empty())
        {
            visit(find(dep), find, seen, order);
        }
        order.push(path);
    }
    let mut seen = BTreeSet::new();
    let mut order = Vec::new();
    for m in wanted {
        visit(find(m), &find, &mut seen, &mut order);
    }
    order
}

/// Copies `binary` and the shared libraries `ldd` lists into `root`, at the same paths.
fn install_with_libraries(binary: &Path, root: &Path) {
    let mut files = vec![binary.to_path_buf()];
    let ldd = Command::new("ldd").arg(binary).output().unwrap();
    for line in String::from_utf8_lossy(&ldd.stdout).lines() {
        let path = match line.split("=>").nth(1) {
            Some(rest) => rest.split_whitespace().next(),
            None => line.split_whitespace().next(),
        };
        if let Some(p) = path.filter(|p| p.starts_with('/')) {
            files.push(PathBuf::from(p));
        }
    }
    for f in files {
        let dst = root.join(f.strip_prefix("/").unwrap());
        fs::create_dir_all(dst.parent().unwrap()).unwrap();
        fs::copy(fs::canonicalize(&f).unwrap(), &dst).unwrap();
    }
}

fn build_initramfs(dir: &Path, key: &[u8], marker: &[u8]) -> PathBuf {
    let root = dir.join("root");
    for d in [
        "bin",
        "sbin",
        "proc",
        "sys",
        "dev",
        "run/cryptsetup",
        "lib/modules",
        "tmp",
    ] {
        fs::create_dir_all(root.join(d)).unwrap();
    }
    let busybox = Command::new("sh")
        .args(["-c", "command -v busybox"])
        .output()
        .unwrap();
    let busybox = PathBuf::from(String::from_utf8_lossy(&busybox.stdout).trim());
    fs::copy(&busybox, root.join("bin/busybox")).unwrap();
    let cryptsetup = Command::new("sh")
        .args(["-c", "command -v cryptsetup"])
        .output()
        .unwrap();
    install_with_libraries(
        Path::new(String::from_utf8_lossy(&cryptsetup.stdout).trim()),
        &root,
    );
    let mut order = String::new();
    for m in modules_in_load_order(MODULES) {
        let name = m.file_name().unwrap().to_string_lossy().into_owned();
        fs::copy(&m, root.join("lib/modules").join(&name)).unwrap();
        order.push_str(&name);
        order.push('\n');
    }
    fs::write(root.join("modules.order"), order).unwrap();
    fs::write(root.join("key"), key).unwrap();
    fs::write(root.join("marker.bin"), marker).unwrap();
    let init = r#"#!/bin/busybox sh
/bin/busybox --install -s /bin
mount -t proc proc /proc
mount -t sysfs sys /sys
mount -t devtmpfs dev /dev
for m in $(cat /modules.order); do insmod /lib/modules/$m || echo "GUEST: insmod $m failed"; done
i=0; while [ ! -b /dev/vda ] && [ $i -lt 50 ]; do sleep 0.1; i=$((i+1)); done
if cryptsetup open --type luks2 --key-file /key /dev/vda tenant; then
  dd if=/marker.bin of=/dev/mapper/tenant bs=1M count=1 seek=1 conv=fsync 2>/dev/null
  dd if=/dev/mapper/tenant bs=1M skip=1 count=1 2>/dev/null | cmp - /marker.bin && echo GUEST-MARKER-READBACK-OK
  cryptsetup close tenant && echo GUEST-CLOSED
else
  echo GUEST-OPEN-FAILED
fi
sync
echo GUEST-DONE
poweroff -f
"#;
    fs::write(root.join("init"), init).unwrap();
    fs::set_permissions(
        root.join("init"),
        std::os::unix::fs::PermissionsExt::from_mode(0o755),
    )
    .unwrap();
    let initrd = dir.join("initrd.cpio");
    let status = Command::new("sh")
        .arg("-c")
        .arg(format!(
            "cd '{}' && find . | cpio -o -H newc --quiet > '{}'",
            root.display(),
            initrd.display()
        ))
        .status()
        .unwrap();
    assert!(status.success(), "cpio failed");
    initrd
}

/// Boots the guest on `image` and returns its serial output.
fn run_guest(image: &Path, initrd: &Path) -> String {
    let mut child = Command::new("qemu-system-x86_64")
        .args([
            "-nographic",
            "-no-reboot",
            "-m",
            "512",
            "-smp",
            "1",
            "-accel",
            "tcg",
        ])
        .arg("-kernel")
        .arg(kernel_dir().join("vmlinuz"))
        .arg("-initrd")
        .arg(initrd)
        .args(["-append", "console=ttyS0 panic=-1 rdinit=/init loglevel=3"])
        .arg("-drive")
        .arg(format!(
            "file={},format=raw,if=virtio,cache=writethrough",
            image.display()
        ))
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()
        .unwrap();
    let mut stdout = child.stdout.take().unwrap();
    let reader = std::thread::spawn(move || {
        let mut out = Vec::new();
        let _ = stdout.read_to_end(&mut out);
        String::from_utf8_lossy(&out).into_owned()
    });
    let start = Instant::now();
    loop {
        if child.try_wait().unwrap().is_some() {
            break;
        }
        if start.elapsed() > GUEST_TIMEOUT {
            let _ = child.kill();
            let _ = child.wait();
            break;
        }
        std::thread::sleep(Duration::from_millis(200));
    }
    reader.join().unwrap()
}

fn contains(haystack: &[u8], needle: &[u8]) -> bool {
    haystack.windows(needle.len()).any(|w| w == needle)
}

#[test]
fn guest_writes_through_dm_crypt_and_no_plaintext_reaches_the_host_disk() {
    if let Some(reason) = missing_prerequisite() {
        tenantvm_skip::skip!("{reason}");
    }
    let dir = tempfile::tempdir().unwrap();
    let kek = HostKek::load(&KekSource::File(dir.path().join("kek"))).unwrap();
    let keys = KeyStore::new(&dir.path().join("keys"), kek).unwrap();
    let key = keys.create("guest-tenant").unwrap();
    let image = dir.path().join("guest-tenant.img");
    create_image(&image, IMAGE_BYTES, &key, KeyslotCost::TEST).unwrap();

    let mut tag = [0u8; 8];
    rand::RngCore::fill_bytes(&mut rand::rng(), &mut tag);
    let needle = format!("TENANTVM-PLAINTEXT-MARKER-{}", hex::encode(tag)).into_bytes();
    let marker: Vec<u8> = needle.iter().copied().cycle().take(MARKER_BYTES).collect();
    // Positive control: the scan finds the marker where it is.
    assert!(contains(&marker, &needle));

    let initrd = build_initramfs(dir.path(), key.expose(), &marker);
    let serial = run_guest(&image, &initrd);
    assert!(
        serial.contains("GUEST-MARKER-READBACK-OK") && serial.contains("GUEST-CLOSED"),
        "the guest did not write and read back the marker; serial output:\n{serial}"
    );

    let bytes = fs::read(&image).unwrap();
    assert!(
        !contains(&bytes, &needle),
        "plaintext marker found in the image file"
    );
    // Something was written: the marker's sectors hold ciphertext, not zeroes.
    let data = &bytes[usize::try_from(HEADER_BYTES).unwrap() + MARKER_BYTES..][..MARKER_BYTES];
    assert!(data.iter().any(|&b| b != 0), "nothing reached the image");

    let report = crypto_shred(&keys, "guest-tenant", &image).unwrap();
    assert_eq!(report.image.old_key_rejected, Some(true));
    assert!(report.wrapped_key_absent && !image.exists());
}
