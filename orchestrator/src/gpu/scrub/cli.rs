//! The scrub as a command (`tenantvm` wires it as a subcommand) and the parent's side of
//! running it in a child process, which is how a MIG instance is scrubbed: CUDA sees only the
//! instance named in the child's `CUDA_VISIBLE_DEVICES`.

use std::ffi::OsString;
use std::io::Write;
use std::path::Path;
use std::process::Command;

use super::{scrub_gpu, DeviceSelector, ScrubError, ScrubOptions, ScrubOutcome, VerifyMode};

/// Arguments of the scrub command.
#[derive(Debug, Clone, clap::Args)]
pub struct ScrubArgs {
    /// The device: a CUDA ordinal, or a `GPU-...`/`MIG-...` UUID (`nvidia-smi -L`).
    #[arg(long)]
    pub device: String,
    /// Read back every byte (`full`) or sampled windows of each chunk (`sampled`).
    #[arg(long, value_enum, default_value_t = VerifyMode::Full)]
    pub verify: VerifyMode,
    /// Scrub at most this many bytes (for tests; the default is all the device gives).
    #[arg(long)]
    pub max_bytes: Option<u64>,
    /// The CUDA driver library.
    #[arg(long, default_value = super::CUDA_LIBRARY)]
    pub library: OsString,
    /// Print the outcome as one JSON object (what [`scrub_in_child`] reads).
    #[arg(long)]
    pub json: bool,
}

/// Runs the scrub and prints its outcome to `out`. A scrub that ran but did not pass is still
/// `Ok` (its outcome says `passed: false`); `Err` means it could not run.
pub fn run_scrub(args: &ScrubArgs, out: &mut dyn Write) -> Result<ScrubOutcome, ScrubError> {
    let opts = ScrubOptions {
        verify: args.verify,
        max_bytes: args.max_bytes,
        library: args.library.clone(),
    };
    let outcome = scrub_gpu(&DeviceSelector::parse(&args.device), &opts)?;
    if args.json {
        serde_json::to_writer(&mut *out, &outcome)?;
        writeln!(out)?;
    } else {
        writeln!(
            out,
            "{} ({}): {}\n  zeroed {} of {} bytes ({:.2}%) in {:.2} s, {:.1} GB/s{}\n  read back {} bytes ({}) in {:.2} s: {} non-zero",
            outcome.device,
            outcome.device_name,
            if outcome.passed { "PASSED, verified" } else { "FAILED" },
            outcome.scrubbed_bytes,
            outcome.total_bytes,
            outcome.coverage() * 100.0,
            outcome.zero_seconds,
            outcome.zero_gbps,
            outcome
                .peak_gbps
                .map(|p| format!(" ({:.0}% of the {p:.0} GB/s peak)", outcome.zero_gbps / p * 100.0))
                .unwrap_or_default(),
            outcome.verified_bytes,
            if args.verify == VerifyMode::Full { "full" } else { "sampled" },
            outcome.verify_seconds,
            outcome.nonzero_bytes,
        )?;
    }
    Ok(outcome)
}

/// Runs `program subcommand... --device <target> --verify <mode> --json` with
/// `CUDA_VISIBLE_DEVICES=<target>` and returns the outcome it prints. `target` is the UUID of
/// the GPU or MIG instance released by the departing tenant.
pub fn scrub_in_child(
    program: &Path,
    subcommand: &[&str],
    target: &str,
    verify: VerifyMode,
) -> Result<ScrubOutcome, ScrubError> {
    let child_err = |reason: String| ScrubError::Child {
        program: program.display().to_string(),
        reason,
    };
    let mode = match verify {
        VerifyMode::Full => "full",
        VerifyMode::Sampled => "sampled",
    };
    let output = Command::new(program)
        .args(subcommand)
        .args(["--device", target, "--verify", mode, "--json"])
        .env("CUDA_VISIBLE_DEVICES", target)
        .output()
        .map_err(|e| child_err(e.to_string()))?;
    if !output.status.success() {
        let stderr = String::from_utf8_lossy(&output.stderr);
        let tail: String = stderr
            .chars()
            .rev()
            .take(2000)
            .collect::<Vec<_>>()
            .into_iter()
            .rev()
            .collect();
        return Err(child_err(format!("{}: {}", output.status, tail.trim())));
    }
    let line = output
        .stdout
        .split(|&b| b == b'\n')
        .rev()
        .find(|l| !l.is_empty())
        .unwrap_or_default();
    serde_json::from_slice(line).map_err(|e| child_err(format!("unreadable outcome: {e}")))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn child_outcome_is_read_from_its_last_stdout_line() {
        let dir = tempfile::tempdir().unwrap();
        let script = dir.path().join("fake-scrub.sh");
        let outcome = super::super::simulate_scrub("MIG-x", 1 << 20, false);
        let json = serde_json::to_string(&outcome).unwrap();
        // A stand-in child (named as such) that checks what the parent passes it.
        let body = format!(
            "#!/bin/sh\n[ \"$CUDA_VISIBLE_DEVICES\" = MIG-x ] || exit 3\n[ \"$1 $2 $3 $4 $5 $6\" = \"scrub --device MIG-x --verify sampled --json\" ] || exit 4\necho noise\necho '{json}'\n"
        );
        std::fs::write(&script, body).unwrap();
        // Run through sh, not exec'd directly: no ETXTBSY race with other test threads forking.
        let script = script.to_str().unwrap();
        let got = scrub_in_child(
            Path::new("/bin/sh"),
            &[script, "scrub"],
            "MIG-x",
            VerifyMode::Sampled,
        )
        .unwrap();
        assert_eq!(got, outcome);
    }

    #[test]
    fn failing_child_reports_status_and_stderr() {
        let err = scrub_in_child(
            Path::new("/bin/sh"),
            &["-c", "echo boom >&2; exit 7", "x"],
            "GPU-1",
            VerifyMode::Full,
        )
        .unwrap_err();
        let text = err.to_string();
        assert!(text.contains("boom") && text.contains('7'), "{text}");
    }
}
