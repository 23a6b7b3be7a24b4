//! What the live host learns from `/proc` itself: how much CPU busy shells get (inside a
//! probe's cgroup and outside it, check 8) and which processes a uid still has (check 10).

use std::path::Path;
use std::time::Duration;

use super::host::HostError;

/// Runs `workers` busy shells (in the cgroup `dir` when given) for `wall`; returns the CPU
/// seconds they took per second. Each shell joins the cgroup itself before it spins.
pub(super) fn busy_cpus(
    dir: Option<&Path>,
    workers: u32,
    wall: Duration,
) -> Result<f64, HostError> {
    let script =
        r#"if [ -n "$1" ]; then echo $$ > "$1/cgroup.procs" || exit 97; fi; while :; do :; done"#;
    let mut children = Vec::new();
    for _ in 0..workers {
        let child = std::process::Command::new("sh")
            .arg("-c")
            .arg(script)
            .arg("tenantvm-verify-busy")
            .arg(dir.map(|d| d.as_os_str().to_owned()).unwrap_or_default())
            .stdin(std::process::Stdio::null())
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null())
            .spawn()
            .map_err(|e| HostError::Failed(format!("cannot run sh: {e}")));
        match child {
            Ok(c) => children.push(c),
            Err(e) => {
                for mut c in children {
                    let _ = c.kill();
                    let _ = c.wait();
                }
                return Err(e);
            }
        }
    }
    std::thread::sleep(wall);
    // SAFETY: sysconf only reads a configuration value.
    let ticks = unsafe { libc::sysconf(libc::_SC_CLK_TCK) }.max(1) as f64;
    let mut seconds = 0.0;
    let mut failed = None;
    for c in &mut children {
        let stat = std::fs::read_to_string(format!("/proc/{}/stat", c.id())).unwrap_or_default();
        // Fields after the command name (which is in parentheses): state is the first;
        // utime and stime are the 12th and 13th.
        let after = stat.rsplit_once(')').map_or("", |(_, r)| r);
        let f: Vec<&str> = after.split_whitespace().collect();
        let used = f
            .get(11)
            .zip(f.get(12))
            .and_then(|(u, s)| Some(u.parse::<f64>().ok()? + s.parse::<f64>().ok()?));
        match used {
            Some(t) => seconds += t / ticks,
            None => failed = Some(c.id()),
        }
    }
    for mut c in children {
        let _ = c.kill();
        let _ = c.wait();
    }
    if let Some(pid) = failed {
        return Err(HostError::Failed(format!(
            "busy process {pid} ended early (could it join the cgroup?)"
        )));
    }
    Ok(seconds / wall.as_secs_f64())
}

/// Pids whose real uid is `uid`.
pub(super) fn processes_of(uid: u32) -> Vec<i32> {
    let Ok(dir) = std::fs::read_dir("/proc") else {
        return Vec::new();
    };
    dir.filter_map(Result::ok)
        .filter_map(|e| e.file_name().to_str()?.parse::<i32>().ok())
        .filter(|pid| {
            std::fs::read_to_string(format!("/proc/{pid}/status"))
                .ok()
                .and_then(|s| {
                    s.lines()
                        .find(|l| l.starts_with("Uid:"))
                        .and_then(|l| l.split_whitespace().nth(1)?.parse::<u32>().ok())
                })
                == Some(uid)
        })
        .collect()
}
