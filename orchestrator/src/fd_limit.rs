//! The daemon's file descriptors: `RLIMIT_NOFILE`'s soft limit raised to the hard limit at
//! start (systemd starts services at a soft 1,024 with a hard limit far above it), so that
//! the front door's connections, the admin API, the store and launches are sized from what
//! the process may really open (`frontdoor::DoorLimits::for_fd_limit`).

use nix::sys::resource::{getrlimit, setrlimit, Resource, RLIM_INFINITY};

/// Where the kernel's ceiling for `RLIMIT_NOFILE` is read when the hard limit is unlimited.
const NR_OPEN: &str = "/proc/sys/fs/nr_open";
/// The ceiling assumed when [`NR_OPEN`] cannot be read (the kernel's default).
const DEFAULT_NR_OPEN: u64 = 1 << 20;

/// What [`raise_soft_limit`] found and left.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FdLimit {
    /// The soft limit found at start.
    pub was: u64,
    /// The soft limit now (the hard limit, or `/proc/sys/fs/nr_open` if that is unlimited).
    pub soft: u64,
    /// The hard limit.
    pub hard: u64,
}

/// Raises this process's `RLIMIT_NOFILE` soft limit to its hard limit. A limit that cannot
/// be raised is left as it was (and reported as such): the caller sizes from `soft`.
pub fn raise_soft_limit() -> std::io::Result<FdLimit> {
    let (was, hard) = getrlimit(Resource::RLIMIT_NOFILE).map_err(std::io::Error::from)?;
    let target = if hard == RLIM_INFINITY {
        std::fs::read_to_string(NR_OPEN)
            .ok()
            .and_then(|s| s.trim().parse().ok())
            .unwrap_or(DEFAULT_NR_OPEN)
    } else {
        hard
    };
    if was >= target {
        return Ok(FdLimit {
            was,
            soft: was,
            hard,
        });
    }
    match setrlimit(Resource::RLIMIT_NOFILE, target, hard) {
        Ok(()) => Ok(FdLimit {
            was,
            soft: target,
            hard,
        }),
        Err(e) => {
            tracing::warn!(error = %e, soft = was, hard, "cannot raise RLIMIT_NOFILE's soft limit");
            Ok(FdLimit {
                was,
                soft: was,
                hard,
            })
        }
    }
}

/// The soft `RLIMIT_NOFILE` now.
pub fn soft_limit() -> std::io::Result<u64> {
    let (soft, _) = getrlimit(Resource::RLIMIT_NOFILE).map_err(std::io::Error::from)?;
    Ok(soft)
}

#[cfg(test)]
mod tests {
    use std::os::unix::process::CommandExt;

    use super::*;

    /// What the child below prints.
    const REPORT: &str = "FD_LIMIT=";

    /// Run by [`a_low_soft_limit_is_raised_to_the_hard_limit`] in a child process started at a
    /// low soft limit: raises it and prints what it found and left.
    #[test]
    #[ignore = "run by a_low_soft_limit_is_raised_to_the_hard_limit in a child process"]
    fn raise_in_a_child() {
        let l = raise_soft_limit().unwrap();
        println!(
            "{REPORT}{} {} {} {}",
            l.was,
            l.soft,
            l.hard,
            soft_limit().unwrap()
        );
    }

    #[test]
    fn a_low_soft_limit_is_raised_to_the_hard_limit() {
        let (_, hard) = getrlimit(Resource::RLIMIT_NOFILE).unwrap();
        let low = 256.min(hard);
        let mut child = std::process::Command::new(std::env::current_exe().unwrap());
        child.args([
            "--ignored",
            "--exact",
            "fd_limit::tests::raise_in_a_child",
            "--nocapture",
        ]);
        // SAFETY: setrlimit is async-signal-safe and touches only the child's limits.
        unsafe {
            child.pre_exec(move || {
                setrlimit(Resource::RLIMIT_NOFILE, low, hard).map_err(std::io::Error::from)
            });
        }
        let out = child.output().unwrap();
        let stdout = String::from_utf8_lossy(&out.stdout);
        let line = stdout
            .lines()
            .find_map(|l| l.strip_prefix(REPORT))
            .unwrap_or_else(|| panic!("no report from the child: {stdout}"));
        let n: Vec<u64> = line.split(' ').map(|v| v.parse().unwrap()).collect();
        let target = if hard == RLIM_INFINITY {
            std::fs::read_to_string(NR_OPEN)
                .unwrap()
                .trim()
                .parse()
                .unwrap()
        } else {
            hard
        };
        // The child started low (the control: the limit was really lowered) and left the
        // soft limit at the hard one.
        assert_eq!(n[0], low, "{line}");
        assert_eq!((n[1], n[2], n[3]), (target, hard, target), "{line}");
    }
}
