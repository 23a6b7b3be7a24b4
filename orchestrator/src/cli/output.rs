//! How the CLI prints: tables and status for people, JSON for scripts, and guest text with
//! control characters replaced (guest output must never drive the operator's terminal).

use std::io::Write;
use std::os::unix::fs::OpenOptionsExt;
use std::path::Path;

use serde::Serialize;

use crate::api::types::TenantView;

pub(super) fn print_json<T: Serialize>(value: &T) {
    match serde_json::to_string_pretty(value) {
        Ok(s) => println!("{s}"),
        Err(e) => eprintln!("tenantvm: cannot encode JSON: {e}"),
    }
}

fn gpu_label(t: &TenantView) -> String {
    match &t.gpu {
        Some(p) => format!("{}:{}", p.gpu, p.label),
        None => "-".into(),
    }
}

fn opt<T: ToString>(v: Option<T>) -> String {
    v.map(|v| v.to_string()).unwrap_or_else(|| "-".into())
}

pub(super) fn print_table(tenants: &[TenantView]) {
    if tenants.is_empty() {
        println!("no tenants");
        return;
    }
    println!(
        "{:<24} {:<13} {:>5} {:>8} {:>8} {:>8}  GPU",
        "NAME", "STATE", "VCPUS", "MEM_MIB", "UID", "PID"
    );
    for t in tenants {
        println!(
            "{:<24} {:<13} {:>5} {:>8} {:>8} {:>8}  {}",
            t.name,
            t.state.as_str(),
            t.spec.vcpus,
            t.spec.memory_mib,
            opt(t.uid),
            opt(t.pid),
            gpu_label(t)
        );
    }
}

pub(super) fn print_status(t: &TenantView) {
    println!("name:       {}", t.name);
    if t.recovering {
        println!(
            "state:      {} (last recorded; the daemon restarted and is still recovering this tenant)",
            t.state
        );
    } else {
        println!("state:      {}", t.state);
    }
    if let Some(e) = &t.error {
        println!("error:      {}", crate::logs::sanitize(e));
    }
    println!(
        "size:       {} vCPU, {} MiB, disk {} GiB",
        t.spec.vcpus, t.spec.memory_mib, t.spec.disk_gib
    );
    println!("uid/gid:    {}", opt(t.uid));
    println!("vmm pid:    {}", opt(t.pid));
    println!("gpu:        {}", gpu_label(t));
    if let Some(op) = &t.op {
        println!("operation:  {op}");
        for s in &t.steps {
            let took = s
                .finished_ms
                .map(|f| format!("{} ms", f - s.started_ms))
                .unwrap_or_else(|| "...".into());
            println!("  {:<14} {:<8} {}", s.step, s.status, took);
            if let Some(e) = &s.error {
                println!("    {}", crate::logs::sanitize(e));
            }
        }
    }
}

/// Prints steps beyond the first `shown` that have finished; returns the new count.
pub(super) fn print_new_steps(name: &str, t: &TenantView, shown: usize) -> usize {
    let mut n = shown;
    for s in t.steps.iter().skip(shown) {
        let Some(f) = s.finished_ms else { break };
        eprintln!(
            "{name}: {:<14} {} ({} ms)",
            s.step,
            s.status,
            f - s.started_ms
        );
        n += 1;
    }
    n
}

pub(super) fn print_guest_text(text: &str) {
    let mut out = std::io::stdout().lock();
    let _ = out.write_all(crate::logs::sanitize(text).as_bytes());
    let _ = out.flush();
}

pub(super) fn write_secret(path: &Path, secret: &str) -> std::io::Result<()> {
    let mut f = std::fs::OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(true)
        .mode(0o600)
        .open(path)?;
    writeln!(f, "{secret}")
}

/// Prints departure receipts as text.
pub(super) fn print_receipts(entries: &[crate::receipt::LogEntry]) {
    if entries.is_empty() {
        println!("no receipts");
        return;
    }
    let mut out = std::io::stdout();
    if let Err(e) = crate::receipt::write_entries(entries, &mut out) {
        eprintln!("tenantvm: {e}");
    }
}
