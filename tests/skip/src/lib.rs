//! Visible test skips.
//!
//! A test that cannot run here (no root, no `/dev/kvm`, no GPU, no nested host...) must not
//! read as a pass. libtest has no "skipped" outcome and captures the output of passing tests,
//! so a skip is recorded twice: `SKIP <test>: <reason>` on standard error (shown with
//! `--nocapture` and when the test fails) and the same line appended to the file named by
//! [`LOG_ENV`], which `scripts/test.sh` sets, counts, and lists after its summary line
//! (`N passed, N failed, N skipped`).
//!
//! ```no_run
//! #[test]
//! fn needs_kvm() {
//!     if !std::path::Path::new("/dev/kvm").exists() {
//!         tenantvm_skip::skip!("/dev/kvm is absent");
//!     }
//!     // ...
//! }
//! ```
//!
//! Helpers that decide for a test (returning `bool` or `Option`) call [`record_skip!`], which
//! records without returning, or [`record`] with an explicit test name.

use std::fmt::Display;
use std::io::Write;

/// The environment variable naming the file that skips are appended to.
pub const LOG_ENV: &str = "TENANTVM_SKIP_LOG";

/// Records that `test` was skipped because of `reason`: prints `SKIP <test>: <reason>` to
/// standard error and appends that line to `$TENANTVM_SKIP_LOG` when it is set. The reason
/// is put on one line. A log that cannot be written is reported on standard error; the test
/// still skips.
pub fn record(test: &str, reason: impl Display) {
    let line = skip_line(test, &reason.to_string());
    eprint!("{line}");
    if let Some(path) = std::env::var_os(LOG_ENV) {
        // One write of one short line to a file opened with O_APPEND: lines from tests
        // running in parallel, in this process or others, do not interleave.
        let written = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&path)
            .and_then(|mut f| f.write_all(line.as_bytes()));
        if let Err(e) = written {
            eprintln!(
                "tenantvm-skip: cannot append to {} ({LOG_ENV}): {e}",
                std::path::Path::new(&path).display()
            );
        }
    }
}

/// The name of the running test as `crate::path::to::test`: libtest runs each test on a
/// thread named after it. Outside a test thread, `crate::<unnamed thread>`.
pub fn test_id(crate_name: &str) -> String {
    match std::thread::current().name() {
        Some(name) if name != "main" => format!("{crate_name}::{name}"),
        _ => format!("{crate_name}::<unnamed thread>"),
    }
}

fn skip_line(test: &str, reason: &str) -> String {
    let reason: String = reason
        .chars()
        .map(|c| if c == '\n' || c == '\r' { ' ' } else { c })
        .collect();
    format!("SKIP {test}: {}\n", reason.trim())
}

/// Records a skip of the calling test (named after its thread and crate) and returns from
/// the calling function. Takes `format!` arguments.
#[macro_export]
macro_rules! skip {
    ($($reason:tt)+) => {{
        $crate::record(&$crate::test_id(env!("CARGO_CRATE_NAME")), format_args!($($reason)+));
        return;
    }};
}

/// Records a skip of the calling test (named after its thread and crate) without returning,
/// for helpers that tell their caller to skip. Takes `format!` arguments.
#[macro_export]
macro_rules! record_skip {
    ($($reason:tt)+) => {
        $crate::record(&$crate::test_id(env!("CARGO_CRATE_NAME")), format_args!($($reason)+))
    };
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_line_names_the_test_and_keeps_the_reason_on_one_line() {
        assert_eq!(
            skip_line("guest_smp::two", "no /dev/kvm\n(ENOENT) "),
            "SKIP guest_smp::two: no /dev/kvm (ENOENT)\n"
        );
    }

    #[test]
    fn the_test_id_is_the_libtest_thread_name() {
        assert_eq!(
            test_id("tenantvm_skip"),
            "tenantvm_skip::tests::the_test_id_is_the_libtest_thread_name"
        );
    }

    #[test]
    fn a_skip_is_appended_to_the_log_named_by_the_environment() {
        let dir = std::env::temp_dir().join(format!("tenantvm-skip-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let log = dir.join("skips");
        // The variable is read in a child process so that this test does not change the
        // environment of the others running beside it.
        let exe = std::env::current_exe().unwrap();
        let out = std::process::Command::new(exe)
            .args([
                "--exact",
                "tests::child_records_two_skips",
                "--ignored",
                "--nocapture",
            ])
            .env(LOG_ENV, &log)
            .output()
            .unwrap();
        assert!(out.status.success(), "{out:?}");
        let text = std::fs::read_to_string(&log).unwrap();
        std::fs::remove_dir_all(&dir).unwrap();
        assert_eq!(
            text,
            "SKIP tenantvm_skip::tests::child_records_two_skips: first\n\
             SKIP tenantvm_skip::tests::child_records_two_skips: second 2\n"
        );
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(
            stderr.contains("SKIP tenantvm_skip::tests::child_records_two_skips: first"),
            "{stderr}"
        );
    }

    #[test]
    #[ignore = "run by a_skip_is_appended_to_the_log_named_by_the_environment in a child process"]
    fn child_records_two_skips() {
        record_skip!("first");
        skip!("second {}", 2);
    }
}
