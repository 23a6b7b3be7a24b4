//! `tenantvm`, the CLI, as the scenario programs run it against their tenantvmd.

use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::time::Instant;

use crate::scenario::Daemon;

/// `tenantvm` against one daemon, each command with the token file it is given.
pub struct Cli {
    /// The `tenantvm` binary.
    pub bin: PathBuf,
    /// The daemon's socket.
    pub socket: PathBuf,
}

impl Cli {
    /// Runs `tenantvm ARGS` with `token`; a failure to start it reads as exit code 127.
    pub fn run(&self, token: &Path, args: &[&str]) -> Output {
        Command::new(&self.bin)
            .arg("--socket")
            .arg(&self.socket)
            .arg("--token-file")
            .arg(token)
            .args(args)
            .env_remove("TENANTVM_TOKEN")
            .stdin(Stdio::null())
            .output()
            .unwrap_or_else(|e| Output {
                status: std::os::unix::process::ExitStatusExt::from_raw(127 << 8),
                stdout: Vec::new(),
                stderr: format!("cannot run {}: {e}", self.bin.display()).into_bytes(),
            })
    }

    /// Runs the command; an error with its output when it fails.
    pub fn ok(&self, token: &Path, args: &[&str], d: &Daemon) -> Result<Output, String> {
        let t = Instant::now();
        let o = self.run(token, args);
        if !o.status.success() {
            return Err(format!(
                "tenantvm {}: {}: {}{}\ndaemon log:\n{}",
                args.join(" "),
                o.status,
                String::from_utf8_lossy(&o.stdout),
                String::from_utf8_lossy(&o.stderr),
                d.log_tail()
            ));
        }
        println!(
            "ok: tenantvm {} ({:.1} s)",
            args.iter().take(2).copied().collect::<Vec<_>>().join(" "),
            t.elapsed().as_secs_f64()
        );
        Ok(o)
    }
}
