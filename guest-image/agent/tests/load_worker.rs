//! The load worker as the agent runs it: this crate's binary with `load-worker ...`. A
//! memory load touches what it asks and reports it; bad arguments and the caps are refused
//! with exit 1 before anything is allocated.

use std::process::Command;

fn worker(args: &[&str]) -> std::process::Output {
    Command::new(env!("CARGO_BIN_EXE_tenantvm-agent"))
        .arg("load-worker")
        .args(args)
        .output()
        .unwrap()
}

#[test]
fn a_memory_load_reports_what_it_touched_and_bad_loads_exit_1() {
    let out = worker(&["memory", "24", "1", "/"]);
    assert!(out.status.success(), "{out:?}");
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(text.ends_with("progress 24\n"), "{text}");
    for bad in [
        &["memory", "70000", "1", "/"][..],
        &["cpu", "1", "999", "/"],
        &["swap", "1", "1", "/"],
        &["memory", "1"],
    ] {
        let out = worker(bad);
        assert_eq!(out.status.code(), Some(1), "{bad:?}: {out:?}");
        assert!(
            String::from_utf8_lossy(&out.stderr).contains("usage"),
            "{bad:?}"
        );
    }
}
