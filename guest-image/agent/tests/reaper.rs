//! The reaper in its own process (it reaps every child of the process it runs in).

use std::process::Command;
use std::time::Duration;

use tenantvm_agent::reaper::Reaper;

#[test]
fn reaper_reports_exit_codes_signals_and_reaps_orphans() {
    let reaper = Reaper::start().unwrap();
    let child = reaper
        .spawn(Command::new("sh").args(["-c", "exit 7"]))
        .unwrap();
    assert_eq!(reaper.wait(child.pid, Duration::from_secs(30)), Some(7));

    let child = reaper
        .spawn(Command::new("sh").args(["-c", "kill -9 $$"]))
        .unwrap();
    assert_eq!(reaper.wait(child.pid, Duration::from_secs(30)), Some(137));

    let child = reaper.spawn(Command::new("sleep").arg("30")).unwrap();
    assert_eq!(reaper.wait(child.pid, Duration::from_millis(100)), None);
    // SAFETY: kill(2) on a pid we spawned and have not reaped.
    unsafe { libc::kill(child.pid as i32, libc::SIGKILL) };
    assert_eq!(reaper.wait(child.pid, Duration::from_secs(30)), Some(137));

    // A second start() is the same reaper: children spawned through either are seen by both.
    let again = Reaper::start().unwrap();
    let child = again
        .spawn(Command::new("sh").args(["-c", "exit 3"]))
        .unwrap();
    assert_eq!(reaper.wait(child.pid, Duration::from_secs(30)), Some(3));

    // A child the agent does not watch is reaped all the same (no zombie left).
    #[allow(clippy::zombie_processes)] // The point: nobody but the reaper waits for it.
    let pid = Command::new("true").spawn().unwrap().id();
    let mut reaped = false;
    for _ in 0..300 {
        if !std::path::Path::new(&format!("/proc/{pid}")).exists() {
            reaped = true;
            break;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    assert!(reaped, "unwatched child {pid} was left a zombie");
}
