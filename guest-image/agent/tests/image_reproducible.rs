//! The image recipe is reproducible: two builds from the same inputs give byte-identical
//! outputs, and changing an input (SOURCE_DATE_EPOCH) changes the hashes, which shows the
//! comparison can fail.

mod common;

use std::path::Path;

use common::{build_image, image_build_blocker, repo_root};

fn read(dir: &Path, name: &str) -> String {
    std::fs::read_to_string(dir.join(name))
        .unwrap_or_else(|e| panic!("{}: {e}", dir.join(name).display()))
}

#[test]
fn same_inputs_give_the_same_hashes() {
    if let Some(why) = image_build_blocker() {
        tenantvm_skip::skip!("{why}");
    }
    let base = repo_root().join("target/guest-image-repro");
    let (a, b, c) = (base.join("a"), base.join("b"), base.join("c"));
    let first = build_image(&a, "1600000000");
    let second = build_image(&b, "1600000000");
    eprintln!(
        "image build: {:.1} s, rebuild: {:.1} s",
        first.as_secs_f64(),
        second.as_secs_f64()
    );
    assert_eq!(read(&a, "SHA256SUMS"), read(&b, "SHA256SUMS"));
    assert_eq!(read(&a, "manifest.json"), read(&b, "manifest.json"));
    let manifest: serde_json::Value = serde_json::from_str(&read(&a, "manifest.json")).unwrap();
    assert!(manifest["initramfs_contents"]["/init"].is_string());
    assert!(manifest["initramfs_contents"]["/payload/model.json"].is_string());

    build_image(&c, "1600000001");
    let sums = |d: &Path| {
        read(d, "SHA256SUMS")
            .lines()
            .find(|l| l.ends_with("initramfs.cpio.gz"))
            .unwrap()
            .to_string()
    };
    assert_ne!(
        sums(&a),
        sums(&c),
        "the initramfs hash must depend on its inputs"
    );
}
