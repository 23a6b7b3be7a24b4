//! How the CLI prints: tables and status for people, JSON for scripts. Everything goes to
//! a writer and returns its I/O error, so that a reader that went away (`| head`) ends the
//! command quietly instead of a panic. Text a tenant controls never drives the operator's
//! terminal: one-line fields go through [`crate::untrusted::one_line`] (control characters,
//! newlines included, escaped), multi-line guest output through
//! [`crate::untrusted::multi_line`].

use std::io::{self, Write};
use std::path::Path;

use serde::Serialize;

use crate::api::types::TenantView;
use crate::untrusted::{multi_line, one_line};

pub(super) fn print_json<T: Serialize>(out: &mut dyn Write, value: &T) -> io::Result<()> {
    serde_json::to_writer_pretty(&mut *out, value).map_err(io::Error::from)?;
    writeln!(out)
}

fn gpu_label(t: &TenantView) -> String {
    match &t.gpu {
        Some(p) => format!("{}:{}", p.gpu, p.label),
        None => "-".into(),
    }
}

fn opt<T: ToString>(v: Option<T>) -> String {
    v.map_or_else(|| "-".into(), |v| v.to_string())
}

pub(super) fn print_table(out: &mut dyn Write, tenants: &[TenantView]) -> io::Result<()> {
    if tenants.is_empty() {
        return writeln!(out, "no tenants");
    }
    writeln!(
        out,
        "{:<24} {:<13} {:>5} {:>8} {:>8} {:>8}  GPU",
        "NAME", "STATE", "VCPUS", "MEM_MIB", "UID", "PID"
    )?;
    for t in tenants {
        writeln!(
            out,
            "{:<24} {:<13} {:>5} {:>8} {:>8} {:>8}  {}",
            one_line(&t.name),
            t.state.as_str(),
            t.spec.vcpus,
            t.spec.memory_mib,
            opt(t.uid),
            opt(t.pid),
            one_line(&gpu_label(t))
        )?;
    }
    Ok(())
}

pub(super) fn print_status(out: &mut dyn Write, t: &TenantView) -> io::Result<()> {
    writeln!(out, "name:       {}", one_line(&t.name))?;
    if t.recovering {
        writeln!(
            out,
            "state:      {} (last recorded; the daemon restarted and is still recovering this tenant)",
            t.state
        )?;
    } else {
        writeln!(out, "state:      {}", t.state)?;
    }
    if let Some(e) = &t.error {
        // Errors quote guests (agent replies, payload errors): one line, escaped.
        writeln!(out, "error:      {}", one_line(e))?;
    }
    writeln!(
        out,
        "size:       {} vCPU, {} MiB, disk {} GiB",
        t.spec.vcpus, t.spec.memory_mib, t.spec.disk_gib
    )?;
    writeln!(out, "uid/gid:    {}", opt(t.uid))?;
    writeln!(out, "vmm pid:    {}", opt(t.pid))?;
    if let Some(channel) = &t.agent_channel {
        writeln!(out, "agent via:  {}", one_line(channel))?;
    }
    writeln!(out, "gpu:        {}", one_line(&gpu_label(t)))?;
    if let Some(op) = &t.op {
        writeln!(out, "operation:  {}", one_line(op))?;
        for s in &t.steps {
            let took = s
                .finished_ms
                .map_or_else(|| "...".into(), |f| format!("{} ms", f - s.started_ms));
            writeln!(
                out,
                "  {:<14} {:<8} {}",
                one_line(&s.step),
                one_line(&s.status),
                took
            )?;
            if let Some(e) = &s.error {
                writeln!(out, "    {}", one_line(e))?;
            }
        }
    }
    Ok(())
}

/// Prints steps beyond the first `shown` that have finished; returns the new count.
pub(super) fn print_new_steps(
    out: &mut dyn Write,
    name: &str,
    t: &TenantView,
    shown: usize,
) -> io::Result<usize> {
    let mut n = shown;
    for s in t.steps.iter().skip(shown) {
        let Some(f) = s.finished_ms else { break };
        writeln!(
            out,
            "{}: {:<14} {} ({} ms)",
            one_line(name),
            one_line(&s.step),
            one_line(&s.status),
            f - s.started_ms
        )?;
        n += 1;
    }
    Ok(n)
}

/// Prints multi-line guest output (a serial console, a completion).
pub(super) fn print_guest_text(out: &mut dyn Write, text: &str) -> io::Result<()> {
    out.write_all(multi_line(text).as_bytes())?;
    out.flush()
}

/// Writes a token for `--token-out`: through the one writer of secrets (atomic, 0600,
/// never through a symlink; an existing file is replaced, not reused with its mode).
pub(super) fn write_secret(path: &Path, secret: &str) -> io::Result<()> {
    crate::keys::write_secret(
        path,
        format!("{secret}\n").as_bytes(),
        crate::keys::Existing::Replace,
    )
    .map(|_| ())
}

/// Prints departure receipts as text.
pub(super) fn print_receipts(
    out: &mut dyn Write,
    entries: &[crate::receipt::LogEntry],
) -> Result<(), crate::receipt::ReceiptError> {
    if entries.is_empty() {
        writeln!(out, "no receipts").map_err(|source| crate::receipt::ReceiptError::Io {
            action: "write",
            path: "standard output".into(),
            source,
        })?;
        return Ok(());
    }
    crate::receipt::write_entries(entries, out)
}

/// Prints the quarantined GPU slices.
pub(super) fn print_quarantine(
    out: &mut dyn Write,
    slices: &[crate::api::types::QuarantinedSliceView],
) -> io::Result<()> {
    if slices.is_empty() {
        return writeln!(out, "no quarantined GPU slices");
    }
    for q in slices {
        writeln!(
            out,
            "{}  slots {:?}  {}",
            one_line(&q.id()),
            q.slots,
            one_line(&q.reason)
        )?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use std::os::unix::fs::PermissionsExt;

    use super::*;

    #[test]
    fn token_out_onto_an_existing_world_readable_file_leaves_it_0600() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("t.token");
        std::fs::write(&path, "old contents that are longer than a token\n").unwrap();
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o644)).unwrap();
        write_secret(&path, "tvm_secret").unwrap();
        let mode = std::fs::metadata(&path).unwrap().permissions().mode() & 0o777;
        assert_eq!(mode, 0o600, "the token file is {mode:o}");
        assert_eq!(std::fs::read_to_string(&path).unwrap(), "tvm_secret\n");
    }

    #[test]
    fn token_out_never_writes_through_a_symlink() {
        let dir = tempfile::tempdir().unwrap();
        let target = dir.path().join("elsewhere");
        std::fs::write(&target, "precious\n").unwrap();
        std::fs::set_permissions(&target, std::fs::Permissions::from_mode(0o644)).unwrap();
        let link = dir.path().join("t.token");
        std::os::unix::fs::symlink(&target, &link).unwrap();
        assert!(write_secret(&link, "tvm_secret").is_err());
        assert_eq!(std::fs::read_to_string(&target).unwrap(), "precious\n");
    }
}
