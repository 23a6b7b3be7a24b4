//! Helpers of the departure tests: the `tenantvm` CLI against a [`TestDaemon`], the daemon's
//! key store and audit log, and a QEMU check (the tests that boot a Linux guest to open the
//! disk run under `--backend qemu-tcg`).

#![allow(dead_code)]

use std::path::{Path, PathBuf};
use std::process::Output;

use tenantvm::keys::{HostKek, KekSource, KeyStore};

use crate::support::daemon::TestDaemon;

/// The QEMU the daemon's qemu-kvm backend runs.
pub const QEMU: &str = "/usr/bin/qemu-system-x86_64";

/// Why tests that need QEMU cannot run, if they cannot.
pub fn qemu_missing() -> Option<String> {
    (!Path::new(QEMU).exists())
        .then(|| format!("{QEMU} is not installed (apt-get install qemu-system-x86)"))
}

/// stdout and stderr together.
pub fn text(o: &Output) -> String {
    crate::support::cli::text(o)
}

/// Asserts the command succeeded.
pub fn ok(o: Output, what: &str, d: &TestDaemon) -> Output {
    crate::support::cli::must(o, what, d)
}

/// Runs `tenantvm` with the admin token (or `token_file`) against the daemon, without the
/// audit-log and receipt-key variables of the caller's environment.
pub fn cli(d: &TestDaemon, token_file: Option<&Path>, args: &[&str]) -> Output {
    let admin = d.admin_token_file();
    crate::support::cli::command(d, token_file.unwrap_or(&admin))
        .args(args)
        .env_remove("TENANTVM_AUDIT_LOG")
        .env_remove("TENANTVM_RECEIPT_PUBKEY")
        .output()
        .unwrap()
}

/// Writes a spec file and creates the tenant (the idle guest) through the CLI, waiting until
/// it runs.
pub fn create(d: &TestDaemon, name: &str, extra: &str) -> Output {
    create_spec(
        d,
        name,
        &format!("memory_mib = 32\n{extra}\n[image]\nname = \"idle\"\n"),
    )
}

/// The stock Debian kernel (scripts/setup.sh), which QEMU boots (the idle guest is for
/// tenantvm-vmm only).
pub fn stock_kernel() -> Option<PathBuf> {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()?
        .to_path_buf();
    let k = root.join(".cache/kernel/vmlinuz");
    k.is_file().then_some(k)
}

/// Why the QEMU-backed tests cannot run, if they cannot.
pub fn qemu_skip() -> Option<String> {
    if let Some(why) = qemu_missing() {
        return Some(why);
    }
    stock_kernel()
        .is_none()
        .then(|| ".cache/kernel/vmlinuz is missing: run scripts/setup.sh".to_string())
}

/// Creates a tenant with a disk booting the stock kernel under the QEMU backend. Boot files
/// must lie under the daemon's image directory: the kernel is copied there once.
pub fn create_qemu(d: &TestDaemon, name: &str, extra: &str) -> Output {
    let stock = stock_kernel().expect("checked by qemu_skip");
    let kernel = d.dir.path().join("img/stock/vmlinuz");
    if !kernel.exists() {
        std::fs::create_dir_all(kernel.parent().unwrap()).unwrap();
        std::fs::copy(&stock, &kernel).unwrap();
    }
    create_spec(
        d,
        name,
        &format!(
            "memory_mib = 128\n{extra}\n[image]\nkernel = \"{}\"\ncmdline = \"console=ttyS0\"\n",
            kernel.display()
        ),
    )
}

/// Creates a tenant from the spec body after its name.
pub fn create_spec(d: &TestDaemon, name: &str, body: &str) -> Output {
    let spec = d.dir.path().join(format!("{name}.toml"));
    std::fs::write(&spec, format!("name = \"{name}\"\n{body}")).unwrap();
    let tok = d.dir.path().join(format!("{name}.token"));
    cli(
        d,
        None,
        &[
            "create",
            spec.to_str().unwrap(),
            "--token-out",
            tok.to_str().unwrap(),
        ],
    )
}

/// The daemon's audit log.
pub fn audit_log(d: &TestDaemon) -> PathBuf {
    d.state_dir().join("audit/receipts.jsonl")
}

/// The daemon's receipt public key.
pub fn public_key(d: &TestDaemon) -> PathBuf {
    d.state_dir().join("audit/receipt-signing.key.pub")
}

/// `tenantvm receipt verify` on the daemon's log.
pub fn verify(d: &TestDaemon) -> Output {
    cli(
        d,
        None,
        &[
            "receipt",
            "verify",
            "--log",
            audit_log(d).to_str().unwrap(),
            "--public-key",
            public_key(d).to_str().unwrap(),
        ],
    )
}

/// Receipts of `tenant` in the audit log (read from the file).
pub fn receipts_of(d: &TestDaemon, tenant: &str) -> Vec<tenantvm::receipt::LogEntry> {
    tenantvm::receipt::AuditLog::new(&audit_log(d))
        .entries()
        .unwrap()
        .into_iter()
        .filter(|e| e.receipt.tenant == tenant)
        .collect()
}

/// The daemon's key store (its KEK file is private to the test daemon).
pub fn keys(d: &TestDaemon) -> KeyStore {
    let kek = HostKek::load(&KekSource::File(d.dir.path().join("host-kek"))).unwrap();
    KeyStore::new(&d.state_dir().join("keys"), kek).unwrap()
}

/// A tenant's disk image.
pub fn image(d: &TestDaemon, tenant: &str) -> PathBuf {
    d.state_dir().join("tenants").join(tenant).join("disk.img")
}
