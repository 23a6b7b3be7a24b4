//! The outer root is reproducible and cached by content: the same inputs give the same bytes
//! (and a second build is a cache hit), and a changed input gives another image. Needs the
//! inputs tests/nested-host/prepare.sh builds (scripts/test.sh runs it first).

use std::path::{Path, PathBuf};
use std::process::Command;

use tenantvm_nested_host::{harness_dir, Inputs};

fn build(inputs: &Path, cache: &Path, format: &str) -> PathBuf {
    let out = Command::new(harness_dir().join("build-rootfs.sh"))
        .args(["--format", format])
        .arg(inputs)
        .env("NH_CACHE", cache)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    PathBuf::from(String::from_utf8(out.stdout).unwrap().trim())
}

fn bytes(dir: &Path, file: &str) -> Vec<u8> {
    std::fs::read(dir.join(file)).unwrap()
}

#[test]
fn the_same_inputs_give_the_same_root_and_a_changed_one_another() {
    let path = Inputs::default_path("debug");
    let inputs = match Inputs::load(&path) {
        Ok(inputs) => inputs,
        Err(e) => tenantvm_skip::skip!("{e}"),
    };
    let tmp = tempfile::tempdir().unwrap();
    let (a, b) = (tmp.path().join("a"), tmp.path().join("b"));
    let first = build(&path, &a, "ext4");
    let second = build(&path, &b, "ext4");
    assert_eq!(
        first.file_name(),
        second.file_name(),
        "the content hash names the image"
    );
    for file in ["root.ext4", "initrd"] {
        assert!(
            bytes(&first, file) == bytes(&second, file),
            "{file} differs between two builds"
        );
    }
    // A second build with the same cache is the same image, not a rebuild.
    let stamp = std::fs::metadata(first.join("root.ext4"))
        .unwrap()
        .modified()
        .unwrap();
    assert_eq!(build(&path, &a, "ext4"), first);
    assert_eq!(
        std::fs::metadata(first.join("root.ext4"))
            .unwrap()
            .modified()
            .unwrap(),
        stamp
    );

    // One byte more in one test guest: another hash, another image.
    let guests = tmp.path().join("guests");
    std::fs::create_dir(&guests).unwrap();
    for entry in std::fs::read_dir(inputs.get("NH_TEST_GUESTS")).unwrap() {
        let entry = entry.unwrap();
        std::fs::copy(entry.path(), guests.join(entry.file_name())).unwrap();
    }
    let mut g = std::fs::read(guests.join("tvm-testguest")).unwrap();
    g.push(0);
    std::fs::write(guests.join("tvm-testguest"), g).unwrap();
    let changed = tmp.path().join("inputs");
    let text = std::fs::read_to_string(&path).unwrap();
    let text: String = text
        .lines()
        .map(|l| match l.strip_prefix("NH_TEST_GUESTS=") {
            Some(_) => format!("NH_TEST_GUESTS={}\n", guests.display()),
            None => format!("{l}\n"),
        })
        .collect();
    std::fs::write(&changed, text).unwrap();
    let third = build(&changed, &a, "ext4");
    assert_ne!(third, first, "a changed input must give another image");
}
