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
    /// The VM's CPU seconds.
    pub cpu_s: f64,
    /// The VM's memory.
    pub memory_bytes: f64,
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
            "tenantvm_vm_cpu_seconds" => row.cpu_s = value,
            "tenantvm_vm_memory_bytes" => row.memory_bytes = value,
            _ => {}
        }
    }
    rows
}

fn ms(v: Option<f64>) -> String {
    v.map(|v| format!("{v:.1}")).unwrap_or_else(|| "-".into())
}

/// Writes the table.
pub fn print(out: &mut dyn Write, rows: &BTreeMap<String, Row>) -> std::io::Result<()> {
    writeln!(
        out,
        "{:<20} {:>8} {:>6} {:>7} {:>6} {:>9} {:>9} {:>9} {:>9} {:>8} {:>8}",
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
        "MEM_MIB"
    )?;
    if rows.is_empty() {
        writeln!(out, "no tenant has metrics yet")?;
    }
    for (tenant, r) in rows {
        writeln!(
            out,
            "{:<20} {:>8} {:>6} {:>7} {:>6} {:>9} {:>9} {:>9} {:>9} {:>8.1} {:>8.1}",
            tenant,
            r.requests,
            r.errors,
            r.refused,
            r.in_flight,
            r.tokens_in,
            r.tokens_out,
            ms(r.first_byte_ms()),
            ms(r.total_ms()),
            r.cpu_s,
            r.memory_bytes / (1024.0 * 1024.0)
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
    }
}
