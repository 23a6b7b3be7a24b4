//! Keeps the jail small: `tenantvm-jail` runs as root, so its dependency tree must not grow
//! an async runtime, an HTTP stack, TLS, a database, a GPU library, or the daemon crate
//! (issue 24). Reads `cargo tree` of this package's normal dependencies, for every target
//! platform, and fails naming any forbidden crate and the path that pulled it in.

use std::process::Command;

/// Crates that must never be in the jail's (normal) dependency tree.
const FORBIDDEN: &[&str] = &[
    "tenantvm",
    "tokio",
    "axum",
    "hyper",
    "rustls",
    "rusqlite",
    "libsqlite3-sys",
    "nvml-wrapper",
    "nvml-wrapper-sys",
];

/// `cargo tree -p tenantvm-jail` with `args` added, one line per crate.
fn cargo_tree(args: &[&str]) -> String {
    let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
    let out = Command::new(cargo)
        .current_dir(env!("CARGO_MANIFEST_DIR"))
        .args([
            "tree",
            "-p",
            "tenantvm-jail",
            "-e",
            "normal",
            "--target",
            "all",
        ])
        .args(args)
        .output()
        .expect("run cargo tree");
    assert!(
        out.status.success(),
        "cargo tree failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout).unwrap()
}

#[test]
fn the_jail_depends_on_nothing_heavy() {
    let tree = cargo_tree(&["--prefix", "none", "--format", "{p}"]);
    let names: Vec<&str> = tree
        .lines()
        .filter_map(|l| l.split_whitespace().next())
        .collect();
    assert!(
        names.first() == Some(&"tenantvm-jail"),
        "unexpected cargo tree output:\n{tree}"
    );
    let found: Vec<&str> = FORBIDDEN
        .iter()
        .copied()
        .filter(|f| names.contains(f))
        .collect();
    if !found.is_empty() {
        let mut why = String::new();
        for f in &found {
            // Who pulls it in: the inverted tree from the crate up to the jail.
            why += &cargo_tree(&["-i", f]);
        }
        panic!("tenantvm-jail (run as root) must not depend on {found:?}; they come in by:\n{why}");
    }
}
