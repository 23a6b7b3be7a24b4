//! Jailed processes seen from the daemon: starting the launcher, recognising the process
//! again by pid + start time, and the exit record the launcher leaves behind.

use std::fs::{self, File, OpenOptions};
use std::io::{ErrorKind, Write};
use std::os::unix::fs::OpenOptionsExt;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

use serde::{Deserialize, Serialize};

use super::{JailError, JailPlan};

/// Exit status of the launcher when the jail could not be built (details in vmm.log).
pub const JAIL_SETUP_FAILED: i32 = 120;

/// How a jailed program ended, as recorded in `<tenant_dir>/vmm.exit`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case", deny_unknown_fields)]
pub enum ExitRecord {
    /// It exited with this status.
    Code(i32),
    /// A signal ended it.
    Signal(i32),
}

impl ExitRecord {
    /// Reads the record; None when there is none (still running, or never started).
    pub fn read(path: &Path) -> Result<Option<Self>, JailError> {
        match fs::read_to_string(path) {
            Ok(text) => serde_json::from_str(&text)
                .map(Some)
                .map_err(|e| JailError::Io {
                    path: path.to_path_buf(),
                    source: std::io::Error::new(ErrorKind::InvalidData, e),
                }),
            Err(e) if e.kind() == ErrorKind::NotFound => Ok(None),
            Err(source) => Err(JailError::Io {
                path: path.to_path_buf(),
                source,
            }),
        }
    }

    /// Writes the record atomically (temp file + rename), never through a symlink.
    pub fn write(&self, path: &Path) -> Result<(), JailError> {
        let tmp = path.with_extension("exit.tmp");
        let text = serde_json::to_string(self).unwrap_or_default();
        let result = (|| -> std::io::Result<()> {
            let mut f = OpenOptions::new()
                .write(true)
                .create(true)
                .truncate(true)
                .mode(0o600)
                .custom_flags(libc::O_NOFOLLOW)
                .open(&tmp)?;
            f.write_all(text.as_bytes())?;
            f.sync_all()?;
            fs::rename(&tmp, path)
        })();
        result.map_err(|source| JailError::Io {
            path: path.to_path_buf(),
            source,
        })
    }

    /// Writes the record unless one is already there (the most precise writer wins).
    pub fn write_if_absent(&self, path: &Path) -> Result<(), JailError> {
        if Self::read(path)?.is_none() {
            self.write(path)?;
        }
        Ok(())
    }

    /// Decodes a wait status.
    pub fn from_wait_status(status: i32) -> Self {
        if libc::WIFSIGNALED(status) {
            Self::Signal(libc::WTERMSIG(status))
        } else {
            Self::Code(libc::WEXITSTATUS(status))
        }
    }
}

/// A started launcher: its host pid and start time identify it across daemon restarts.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Launched {
    /// Host pid of the launcher.
    pub pid: i32,
    /// Field 22 of /proc/PID/stat.
    pub start_time_ticks: u64,
}

/// Starts `tenantvm-jail` with `plan`, stdout and stderr into `log` (vmm.log). The launcher
/// gets its own process group (terminal signals to the daemon do not reach the VM) and an
/// empty environment. The daemon does not wait for it here; see [`wait_nohang`].
pub fn spawn_launcher(
    jail_binary: &Path,
    plan: &JailPlan,
    log: &File,
) -> Result<Launched, JailError> {
    plan.validate()?;
    if let Err(e) = fs::remove_file(&plan.exit_file) {
        if e.kind() != ErrorKind::NotFound {
            return Err(JailError::Io {
                path: plan.exit_file.clone(),
                source: e,
            });
        }
    }
    let json = serde_json::to_string(plan).map_err(|e| JailError::InvalidPlan(e.to_string()))?;
    let io = |source| JailError::Io {
        path: jail_binary.to_path_buf(),
        source,
    };
    let mut command = Command::new(jail_binary);
    command
        .arg("--plan")
        .arg(json)
        .env_clear()
        .stdin(Stdio::null())
        .stdout(log.try_clone().map_err(io)?)
        .stderr(log.try_clone().map_err(io)?);
    // A session of its own (and so a process group of its own), apart from the daemon's:
    // when the daemon exits, its session's process groups that are left without a parent
    // in the session get SIGHUP and SIGCONT if any member is stopped, which ended a VMM
    // that was stopped (a debugger, SIGSTOP) with the daemon. A group in a session of its
    // own is orphaned from the start, so nothing is sent when the daemon goes.
    // SAFETY: setsid(2) is async-signal-safe and touches only the child.
    unsafe {
        command.pre_exec(|| {
            if libc::setsid() == -1 {
                return Err(std::io::Error::last_os_error());
            }
            Ok(())
        });
    }
    let child = command.spawn().map_err(io)?;
    let pid =
        i32::try_from(child.id()).map_err(|_| JailError::InvalidPlan("pid out of range".into()))?;
    // The Child handle is dropped without waiting: the backend reaps the launcher through
    // waitpid on its pid, and the launcher outlives a daemon restart.
    drop(child);
    let start_time_ticks = start_time_ticks(pid)?.ok_or_else(|| JailError::Io {
        path: PathBuf::from(format!("/proc/{pid}/stat")),
        source: std::io::Error::new(
            ErrorKind::NotFound,
            "the jail launcher vanished right after starting",
        ),
    })?;
    Ok(Launched {
        pid,
        start_time_ticks,
    })
}

/// Field 22 (starttime) of /proc/PID/stat; None when the process does not exist.
pub fn start_time_ticks(pid: i32) -> Result<Option<u64>, JailError> {
    Ok(read_stat(pid)?.map(|(_, ticks)| ticks))
}

/// State letter and start time from /proc/PID/stat.
fn read_stat(pid: i32) -> Result<Option<(char, u64)>, JailError> {
    let path = PathBuf::from(format!("/proc/{pid}/stat"));
    let text = match fs::read_to_string(&path) {
        Ok(text) => text,
        Err(e) if e.kind() == ErrorKind::NotFound || e.raw_os_error() == Some(libc::ESRCH) => {
            return Ok(None)
        }
        Err(source) => return Err(JailError::Io { path, source }),
    };
    // The command name (field 2) may contain spaces and ')': fields resume after the last ')'.
    let bad = || JailError::Io {
        path: path.clone(),
        source: std::io::Error::new(ErrorKind::InvalidData, "unexpected /proc stat format"),
    };
    let rest = text.rsplit_once(')').map(|(_, r)| r).ok_or_else(bad)?;
    let fields: Vec<&str> = rest.split_whitespace().collect();
    let state = fields
        .first()
        .and_then(|s| s.chars().next())
        .ok_or_else(bad)?;
    let ticks = fields
        .get(19)
        .and_then(|s| s.parse().ok())
        .ok_or_else(bad)?;
    Ok(Some((state, ticks)))
}

/// Whether `pid` is still the live (not zombie) process that started at `ticks`.
pub fn is_alive(pid: i32, ticks: u64) -> Result<bool, JailError> {
    Ok(matches!(read_stat(pid)?, Some((state, t)) if t == ticks && state != 'Z' && state != 'X'))
}

/// Reaps `pid` if it is an exited child of this process; returns its wait status then.
/// None when it still runs or is not our child (e.g. adopted after a daemon restart).
pub fn wait_nohang(pid: i32) -> Option<i32> {
    let mut status = 0;
    // SAFETY: waitpid on one positive pid with a valid out-pointer to a local and WNOHANG.
    let r = unsafe { libc::waitpid(pid, &mut status, libc::WNOHANG) };
    (r == pid).then_some(status)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn exit_record_round_trips_and_first_writer_wins() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("vmm.exit");
        assert_eq!(ExitRecord::read(&path).unwrap(), None);
        ExitRecord::Code(6).write_if_absent(&path).unwrap();
        ExitRecord::Signal(9).write_if_absent(&path).unwrap();
        assert_eq!(ExitRecord::read(&path).unwrap(), Some(ExitRecord::Code(6)));
    }

    #[test]
    fn corrupt_exit_record_is_an_error_not_a_panic() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("vmm.exit");
        fs::write(&path, "garbage").unwrap();
        ExitRecord::read(&path).unwrap_err();
    }

    #[test]
    fn start_time_identifies_this_process() {
        let me = i32::try_from(std::process::id()).unwrap();
        let ticks = start_time_ticks(me).unwrap().unwrap();
        assert!(is_alive(me, ticks).unwrap());
        assert!(!is_alive(me, ticks + 1).unwrap());
    }

    #[test]
    fn exited_child_is_reaped_and_decoded() {
        let mut child = Command::new("/bin/sh")
            .args(["-c", "exit 7"])
            .spawn()
            .unwrap();
        let pid = i32::try_from(child.id()).unwrap();
        let status = loop {
            if let Some(s) = wait_nohang(pid) {
                break s;
            }
            std::thread::sleep(std::time::Duration::from_millis(5));
        };
        assert_eq!(ExitRecord::from_wait_status(status), ExitRecord::Code(7));
        assert_eq!(start_time_ticks(pid).unwrap(), None);
        // Reaped above, so the Child handle has nothing left to wait for.
        child.try_wait().unwrap_err();
    }
}
