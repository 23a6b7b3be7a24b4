//! `tenantvm top`: the per-tenant metrics (`GET /v1/metrics`) as a table, refreshed until
//! interrupted (`--once`: one table). The admin's token shows every tenant, a tenant's
//! token its own.

use std::collections::BTreeMap;
use std::io::Write;
use std::time::Duration;

use clap::Args;
use hyper::Method;

use super::CliFailure;
use crate::api::types::ErrorBody;
use crate::client::{Client, ClientError};

/// `tenantvm top`.
#[derive(Debug, Args)]
pub struct TopArgs {
    /// Print one table and exit.
    #[arg(long)]
    pub once: bool,
    /// Seconds between refreshes.
    #[arg(long, default_value_t = 2, value_parser = clap::value_parser!(u64).range(1..=3600))]
    pub interval_s: u64,
}

/// One tenant's row.
#[derive(Debug, Default, Clone, PartialEq)]
pub struct Row {
    /// Requests answered (any status).
    pub requests: f64,
    /// Of those, answered with a status of 400 or more.
    pub errors: f64,
    /// Refused by a quota.
    pub refused: f64,
    /// In flight now.
    pub in_flight: f64,
    /// Prompt tokens.
    pub tokens_in: f64,
    /// Completion tokens.
    pub tokens_out: f64,
    first_byte: (f64, f64),
    total: (f64, f64),
    /// The VM's CPU seconds, if its cgroup was read.
    pub cpu_s: Option<f64>,
    /// The VM's memory, if its cgroup was read.
    pub memory_bytes: Option<f64>,
    /// Bytes the VM's disks read, if its VMM reports them.
    pub disk_read_bytes: Option<f64>,
    /// Bytes the VM's disks wrote, if its VMM reports them.
    pub disk_write_bytes: Option<f64>,
    /// Disk requests (read, write, flush), if its VMM reports them.
    pub disk_ops: Option<f64>,
    /// GPU memory in use in the slice, if the GPU backend reads it.
    pub gpu_used_bytes: Option<f64>,
    /// The slice's GPU memory.
    pub gpu_total_bytes: Option<f64>,
    /// The slice's utilisation, percent, if known.
    pub gpu_percent: Option<f64>,
    /// Whether the GPU figures come from a simulated host.
    pub gpu_simulated: bool,
}

impl Row {
    /// Mean time to the first piece of an answer, in ms.
    pub fn first_byte_ms(&self) -> Option<f64> {
        (self.first_byte.1 > 0.0).then(|| 1000.0 * self.first_byte.0 / self.first_byte.1)
    }

    /// Mean time to the end of an answer, in ms.
    pub fn total_ms(&self) -> Option<f64> {
        (self.total.1 > 0.0).then(|| 1000.0 * self.total.0 / self.total.1)
    }
}

fn label<'a>(labels: &'a str, name: &str) -> Option<&'a str> {
    let start = labels.find(&format!("{name}=\""))? + name.len() + 2;
    let len = labels[start..].find('"')?;
    Some(&labels[start..start + len])
}

/// Sums the text exposition into one row per tenant.
pub fn parse(text: &str) -> BTreeMap<String, Row> {
    let mut rows: BTreeMap<String, Row> = BTreeMap::new();
    for line in text.lines().filter(|l| !l.starts_with('#')) {
        let Some((series, value)) = line.rsplit_once(' ') else {
            continue;
        };
        let Ok(value) = value.parse::<f64>() else {
            continue;
        };
        let (name, labels) = series.split_once('{').unwrap_or((series, ""));
        let Some(tenant) = label(labels, "tenant") else {
            continue;
        };
        let row = rows.entry(tenant.to_string()).or_default();
        match name {
            "tenantvm_frontdoor_requests_total" => {
                row.requests += value;
                if label(labels, "status")
                    .and_then(|s| s.parse::<u16>().ok())
                    .is_some_and(|s| s >= 400)
                {
                    row.errors += value;
                }
            }
            "tenantvm_frontdoor_refusals_total" => row.refused += value,
            "tenantvm_frontdoor_in_flight" => row.in_flight += value,
            "tenantvm_frontdoor_tokens_total" => match label(labels, "kind") {
                Some("prompt") => row.tokens_in += value,
                Some("completion") => row.tokens_out += value,
                _ => {}
            },
            "tenantvm_frontdoor_first_byte_seconds_sum" => row.first_byte.0 += value,
            "tenantvm_frontdoor_first_byte_seconds_count" => row.first_byte.1 += value,
            "tenantvm_frontdoor_request_seconds_sum" => row.total.0 += value,
            "tenantvm_frontdoor_request_seconds_count" => row.total.1 += value,
            "tenantvm_vm_cpu_seconds" => row.cpu_s = Some(value),
            "tenantvm_vm_memory_bytes" => row.memory_bytes = Some(value),
            "tenantvm_vm_disk_bytes" => match label(labels, "op") {
                Some("read") => row.disk_read_bytes = Some(value),
                Some("write") => row.disk_write_bytes = Some(value),
                _ => {}
            },
            "tenantvm_vm_disk_operations" => {
                *row.disk_ops.get_or_insert(0.0) += value;
            }
            "tenantvm_gpu_memory_used_bytes"
            | "tenantvm_gpu_memory_bytes"
            | "tenantvm_gpu_utilization_percent" => {
                row.gpu_simulated = label(labels, "source") == Some("simulated");
                let field = match name {
                    "tenantvm_gpu_memory_used_bytes" => &mut row.gpu_used_bytes,
                    "tenantvm_gpu_memory_bytes" => &mut row.gpu_total_bytes,
                    _ => &mut row.gpu_percent,
                };
                *field = Some(value);
            }
            _ => {}
        }
    }
    rows
}

/// A figure with one decimal, or `-` when it was not read (never a 0.0 that looks measured).
fn ms(v: Option<f64>) -> String {
    v.map_or_else(|| "-".into(), |v| format!("{v:.1}"))
}

fn mib(v: Option<f64>) -> String {
    v.map_or_else(|| "-".into(), |v| format!("{:.1}", v / (1024.0 * 1024.0)))
}

/// `used/total` MiB of the slice, `*` after it when the host is simulated.
fn gpu_memory(r: &Row) -> String {
    match (r.gpu_used_bytes, r.gpu_total_bytes) {
        (Some(u), Some(t)) => format!(
            "{:.0}/{:.0}{}",
            u / (1024.0 * 1024.0),
            t / (1024.0 * 1024.0),
            if r.gpu_simulated { "*" } else { "" }
        ),
        _ => "-".into(),
    }
}

/// Writes the table.
pub fn print(out: &mut dyn Write, rows: &BTreeMap<String, Row>) -> std::io::Result<()> {
    writeln!(
        out,
        "{:<20} {:>8} {:>6} {:>7} {:>6} {:>9} {:>9} {:>9} {:>9} {:>8} {:>8} {:>9} {:>9} {:>8} {:>14} {:>5}",
        "TENANT",
        "REQS",
        "ERRS",
        "REFUSED",
        "INFL",
        "TOK_IN",
        "TOK_OUT",
        "TTFB_MS",
        "TOTAL_MS",
        "CPU_S",
        "MEM_MIB",
        "DISK_RD_MIB",
        "DISK_WR_MIB",
        "DISK_OPS",
        "GPU_MEM_MIB",
        "GPU_%"
    )?;
    if rows.is_empty() {
        writeln!(out, "no tenant has metrics yet")?;
    }
    for (tenant, r) in rows {
        writeln!(
            out,
            "{:<20} {:>8} {:>6} {:>7} {:>6} {:>9} {:>9} {:>9} {:>9} {:>8} {:>8} {:>11} {:>11} {:>8} {:>14} {:>5}",
            tenant,
            r.requests,
            r.errors,
            r.refused,
            r.in_flight,
            r.tokens_in,
            r.tokens_out,
            ms(r.first_byte_ms()),
            ms(r.total_ms()),
            ms(r.cpu_s),
            mib(r.memory_bytes),
            mib(r.disk_read_bytes),
            mib(r.disk_write_bytes),
            r.disk_ops.map_or_else(|| "-".into(), |v| v.to_string()),
            gpu_memory(r),
            r.gpu_percent.map_or_else(|| "-".into(), |v| v.to_string()),
        )?;
    }
    if rows.values().any(|r| r.gpu_simulated) {
        writeln!(
            out,
            "* simulated GPU host (--gpu-backend sim:FILE): not measured"
        )?;
    }
    Ok(())
}

async fn fetch(client: &Client) -> Result<String, CliFailure> {
    let (status, bytes) = client.raw(Method::GET, "/v1/metrics", None).await?;
    if !status.is_success() {
        let e = match serde_json::from_slice::<ErrorBody>(&bytes) {
            Ok(b) => ClientError::Api {
                status,
                code: b.error.code,
                message: b.error.message,
            },
            Err(_) => ClientError::Decode {
                status,
                detail: String::from_utf8_lossy(&bytes).into_owned(),
            },
        };
        return Err(e.into());
    }
    Ok(String::from_utf8_lossy(&bytes).into_owned())
}

/// Runs `tenantvm top`.
pub async fn run(client: &Client, args: TopArgs, out: &mut dyn Write) -> Result<(), CliFailure> {
    loop {
        let rows = parse(&fetch(client).await?);
        if !args.once {
            // Clear the screen and go home: a live view for a person.
            write!(out, "\x1b[2J\x1b[H")?;
        }
        print(out, &rows)?;
        out.flush()?;
        if args.once {
            return Ok(());
        }
        tokio::time::sleep(Duration::from_secs(args.interval_s)).await;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rows_sum_each_tenants_series() {
        let m = crate::metrics::Metrics::default();
        m.request("alice", "completions", 200);
        m.request("alice", "completions", 404);
        m.request("bob", "models", 200);
        m.refused("alice", crate::metrics::RefusalReason::Rate);
        m.tokens("alice", 4, 6);
        m.first_byte("alice", Duration::from_millis(10));
        m.first_byte("alice", Duration::from_millis(30));
        let rows = parse(&m.render(None));
        let a = &rows["alice"];
        assert_eq!((a.requests, a.errors, a.refused), (2.0, 1.0, 1.0));
        assert_eq!((a.tokens_in, a.tokens_out), (4.0, 6.0));
        assert!((a.first_byte_ms().unwrap() - 20.0).abs() < 0.01);
        assert_eq!(a.total_ms(), None);
        assert_eq!(rows["bob"].requests, 1.0);
        let mut text = Vec::new();
        print(&mut text, &rows).unwrap();
        let text = String::from_utf8(text).unwrap();
        assert!(text.lines().nth(1).unwrap().starts_with("alice"), "{text}");
        assert!(parse("garbage\n# HELP x\nx{tenant=\"a\"} nan-ish\n").is_empty());
        // No CPU, memory, disk or GPU figures: shown as absent, never as a measured 0.0.
        let line = text.lines().nth(1).unwrap();
        let last: Vec<&str> = line.split_whitespace().rev().take(7).collect();
        assert_eq!(last, ["-"; 7], "{text}");
        assert!(!text.contains("simulated"), "{text}");
        // The control: figures that were read are shown.
        let text = format!(
            "{}tenantvm_vm_cpu_seconds{{tenant=\"alice\"}} 2.5\ntenantvm_vm_memory_bytes{{tenant=\"alice\"}} 1048576\n",
            m.render(None)
        );
        let rows = parse(&text);
        assert_eq!(
            (rows["alice"].cpu_s, rows["alice"].memory_bytes),
            (Some(2.5), Some(1_048_576.0))
        );
        let mut shown = Vec::new();
        print(&mut shown, &rows).unwrap();
        let shown = String::from_utf8(shown).unwrap();
        let alice: Vec<&str> = shown.lines().nth(1).unwrap().split_whitespace().collect();
        assert_eq!(&alice[9..11], ["2.5", "1.0"], "{shown}");
    }

    #[test]
    fn disk_and_gpu_columns_show_the_vmm_and_gpu_figures() {
        use tenantvm_gpu::backend::{SliceUsage, UsageSource};
        let m = crate::metrics::Metrics::default();
        m.sample_disk(
            "alice",
            Some(crate::backend::DiskCounters {
                read_bytes: 3 << 20,
                write_bytes: 1 << 19,
                read_ops: 10,
                write_ops: 4,
                flush_ops: 1,
            }),
        );
        m.sample_gpu(
            "alice",
            Some(SliceUsage {
                memory_used_bytes: 512 << 20,
                memory_total_bytes: 10 << 30,
                utilization_percent: Some(42),
                source: UsageSource::Simulated,
            }),
        );
        m.sample_gpu(
            "bob",
            Some(SliceUsage {
                memory_used_bytes: 1 << 20,
                memory_total_bytes: 2 << 20,
                utilization_percent: None,
                source: UsageSource::Nvml,
            }),
        );
        let rows = parse(&m.render(None));
        let a = &rows["alice"];
        assert_eq!(a.disk_read_bytes, Some(3_145_728.0));
        assert_eq!(a.disk_ops, Some(15.0));
        assert_eq!(a.gpu_percent, Some(42.0));
        assert!(a.gpu_simulated);
        let b = &rows["bob"];
        assert_eq!(
            (b.disk_ops, b.gpu_percent, b.gpu_simulated),
            (None, None, false)
        );
        let mut text = Vec::new();
        print(&mut text, &rows).unwrap();
        let text = String::from_utf8(text).unwrap();
        let alice = text.lines().find(|l| l.starts_with("alice")).unwrap();
        for cell in ["3.0", "0.5", "15", "512/10240*", "42"] {
            assert!(
                alice.split_whitespace().any(|c| c == cell),
                "{cell}: {text}"
            );
        }
        let bob = text.lines().find(|l| l.starts_with("bob")).unwrap();
        assert!(bob.split_whitespace().any(|c| c == "1/2"), "{text}");
        assert!(text.contains("* simulated GPU host"), "{text}");
    }
}
