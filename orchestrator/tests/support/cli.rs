//! The `tenantvm` binary run against a [`TestDaemon`], and what the tests read from its
//! output.

use std::path::Path;
use std::process::{Command, Output};

use super::daemon::TestDaemon;

/// `tenantvm --socket <the daemon's> --token-file <token_file>`, with `TENANTVM_TOKEN`
/// cleared so that only the named token is used; the caller adds the arguments.
pub fn command(d: &TestDaemon, token_file: &Path) -> Command {
    let mut c = Command::new(env!("CARGO_BIN_EXE_tenantvm"));
    c.arg("--socket")
        .arg(d.socket())
        .arg("--token-file")
        .arg(token_file)
        .env_remove("TENANTVM_TOKEN");
    c
}

/// Runs `tenantvm <args>` with `token_file` against the daemon and waits for it.
pub fn tenantvm(d: &TestDaemon, token_file: &Path, args: &[&str]) -> Output {
    command(d, token_file).args(args).output().unwrap()
}

/// stdout and stderr together.
pub fn text(o: &Output) -> String {
    format!(
        "{}{}",
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    )
}

/// Asserts the command succeeded, showing its output and the daemon's log if it did not.
pub fn must(o: Output, what: &str, d: &TestDaemon) -> Output {
    assert!(
        o.status.success(),
        "{what}: {:?}\n{}\n--- daemon ---\n{}",
        o.status,
        text(&o),
        d.log()
    );
    o
}
