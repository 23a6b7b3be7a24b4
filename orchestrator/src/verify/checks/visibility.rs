//! Check 7: no cross-tenant visibility in logs and metrics. Two probe tenants: each one's
//! token must be refused on the other's logs (serial, VMM, events) and receipts, while the
//! same reads of its own succeed (the positive control: the probe can see what it should).
//! Then a marker prompt is sent to one probe; it must appear in no host file the daemon
//! writes (store, tenant logs, the daemon's log file if one is named) in plaintext.
//!
//! Every probe credential (its tenant token and an inference key) is tried against the other
//! probe's logs, events, receipts and models through the API, and each probe's metrics (API
//! and front door) must name no other tenant. The marker prompt goes through the front door
//! when one is named (`--front-door`), else through the API; it must then appear in no host
//! file, no metric (names, labels, values, read as the admin) and no probe's log or event.

use super::at_rest::new_marker;
use crate::api::types::LogStream;
use crate::verify::probe::Probe;
use crate::verify::{Check, CheckId, Ctx, HostError, Outcome, Verdict};

/// Check 7.
pub struct VisibilityCheck;

const STREAMS: [LogStream; 3] = [LogStream::Serial, LogStream::Vmm, LogStream::Events];

/// Judges one cross read: `Ok` (it was answered) fails unless it was empty of the other's
/// data, which a receipts listing of zero entries is.
fn cross(out: &mut Outcome, what: &str, result: Result<usize, HostError>) {
    match result {
        Ok(0) => {}
        Ok(n) => {
            out.verdict = Verdict::Fail;
            out.findings.push(format!(
                "{what}: answered with {n} item(s) of another tenant"
            ));
        }
        Err(e) if matches!(e.status(), Some(401 | 403 | 404)) => {}
        Err(e) => {
            if out.verdict == Verdict::Pass {
                out.verdict = Verdict::Inconclusive;
            }
            out.findings
                .push(format!("{what}: neither answered nor refused: {e}"));
        }
    }
}

impl Check for VisibilityCheck {
    fn id(&self) -> CheckId {
        CheckId::Visibility
    }

    fn run(&self, ctx: &Ctx<'_>) -> Result<Outcome, HostError> {
        let a = ctx.probes.create("vis", |_| {})?;
        let b = ctx.probes.create("vis", |_| {})?;
        let mut out = Outcome::new(Verdict::Pass);
        let mut refused = 0;
        let mut own_ok = 0;
        for (reader, owner) in [(&a, &b), (&b, &a)] {
            for stream in STREAMS {
                let what = format!("{} reading {}'s {stream:?} log", reader.name, owner.name);
                let r = ctx.host.logs_with(&owner.name, &reader.token, stream);
                if r.is_err() {
                    refused += 1;
                }
                cross(&mut out, &what, r.map(|text| text.len()));
                // Positive control: its own log is readable with its own token.
                match ctx.host.logs_with(&reader.name, &reader.token, stream) {
                    Ok(_) => own_ok += 1,
                    Err(e) => out.findings.push(format!(
                        "control: {} cannot read its own {stream:?} log: {e}",
                        reader.name
                    )),
                }
            }
            let what = format!("{} reading {}'s receipts", reader.name, owner.name);
            let r = ctx.host.receipts_with(&owner.name, &reader.token);
            if r.is_err() {
                refused += 1;
            }
            cross(&mut out, &what, r);
        }
        out.add("cross_reads_refused", f64::from(refused), "count");
        out.add("own_reads_answered", f64::from(own_ok), "count");
        if own_ok == 0 && out.verdict == Verdict::Pass {
            out.verdict = Verdict::Inconclusive;
            out.findings.push(
                "control: no probe could read even its own logs, so the refusals prove nothing"
                    .into(),
            );
        }
        cross_credentials(ctx, &a, &b, &mut out);
        let marker = new_marker("vis");
        let sent = send_marker(ctx, &a, &marker, &mut out);
        if sent {
            marker_nowhere(ctx, &[&a, &b], &marker, &mut out)?;
        } else if out.verdict == Verdict::Pass {
            out.verdict = Verdict::Inconclusive;
        }
        Ok(out)
    }
}

/// Inference keys, metrics and models: each probe's key against the other's API reads, each
/// probe's metrics (API with its token, front door with its key) naming no other probe.
fn cross_credentials(ctx: &Ctx<'_>, a: &Probe<'_>, b: &Probe<'_>, out: &mut Outcome) {
    let mut own_metrics = 0;
    for (reader, owner) in [(a, b), (b, a)] {
        let what = format!("{} listing {}'s models", reader.name, owner.name);
        cross(
            out,
            &what,
            ctx.host
                .models_with(&owner.name, &reader.token)
                .map(|m| m.len()),
        );
        match ctx.host.metrics_with(Some(&reader.token)) {
            Ok(text) => {
                own_metrics += usize::from(text.contains(reader.name.as_str()));
                leak(
                    out,
                    &format!("{}'s metrics (API)", reader.name),
                    &text,
                    &owner.name,
                );
            }
            Err(e) => out.findings.push(format!(
                "{}: its metrics could not be read: {e}",
                reader.name
            )),
        }
        let key = match ctx.host.inference_key(&reader.name, &reader.token) {
            Ok(k) => k,
            Err(e) => {
                out.findings
                    .push(format!("{}: no inference key: {e}", reader.name));
                continue;
            }
        };
        for stream in STREAMS {
            let what = format!(
                "{}'s inference key reading {}'s {stream:?} log",
                reader.name, owner.name
            );
            cross(
                out,
                &what,
                ctx.host
                    .logs_with(&owner.name, &key, stream)
                    .map(|t| t.len()),
            );
        }
        let what = format!(
            "{}'s inference key reading {}'s receipts",
            reader.name, owner.name
        );
        cross(out, &what, ctx.host.receipts_with(&owner.name, &key));
        let what = format!(
            "{}'s inference key listing {}'s models",
            reader.name, owner.name
        );
        cross(
            out,
            &what,
            ctx.host.models_with(&owner.name, &key).map(|m| m.len()),
        );
        // /v1/models first: the front door counts a request once answered, so /metrics then
        // shows the reader its own series.
        for path in ["/v1/models", "/metrics"] {
            match ctx.host.front_door(&key, path, None) {
                Ok((200, text)) => {
                    if path == "/metrics" {
                        own_metrics += usize::from(text.contains(reader.name.as_str()));
                    }
                    let what = format!("{}'s front-door {path}", reader.name);
                    leak(out, &what, &text, &owner.name);
                }
                Ok((status, _)) => out.findings.push(format!(
                    "{}: the front door answered {status} to its own key on {path}",
                    reader.name
                )),
                Err(HostError::Unsupported(why)) => {
                    out.findings.push(format!("front door not tried: {why}"));
                    break;
                }
                Err(e) => out
                    .findings
                    .push(format!("{}: front door {path}: {e}", reader.name)),
            }
        }
    }
    out.add("own_metrics_answered", own_metrics as f64, "count");
    if own_metrics == 0 && out.verdict == Verdict::Pass {
        out.verdict = Verdict::Inconclusive;
        out.findings.push(
            "control: no probe saw even its own series in the metrics, so \"names no other probe\" proves nothing"
                .into(),
        );
    }
}

/// Fails the check when `text` (what `what` showed a tenant) names `other`.
fn leak(out: &mut Outcome, what: &str, text: &str, other: &str) {
    if text.contains(other) {
        out.verdict = Verdict::Fail;
        out.findings.push(format!(
            "{what} shows another tenant's series or data ({other})"
        ));
    }
}

/// Sends the marker prompt to `p`: through the front door with a key of its own when one
/// is named, else through the API. Whether it was answered.
fn send_marker(ctx: &Ctx<'_>, p: &Probe<'_>, marker: &str, out: &mut Outcome) -> bool {
    let body = serde_json::json!({"prompt": marker, "max_tokens": 4, "temperature": 0.0});
    let door = ctx
        .host
        .inference_key(&p.name, &p.token)
        .and_then(|key| ctx.host.front_door(&key, "/v1/completions", Some(&body)));
    match door {
        Ok((200, _)) => {
            out.add("marker_via_front_door", 1.0, "count");
            return true;
        }
        Ok((status, text)) => out.findings.push(format!(
            "the front door answered {status} to the marker prompt: {}",
            crate::untrusted::one_line(&text)
        )),
        Err(e) => out
            .findings
            .push(format!("the marker prompt went through the API: {e}")),
    }
    match ctx.host.complete(&p.name, &p.token, marker, 4) {
        Ok(_) => true,
        Err(e) => {
            out.findings
                .push(format!("the marker prompt was not accepted: {e}"));
            false
        }
    }
}

/// The marker in no host file (store rows, logs, disks), no metric (read as the admin) and
/// no probe's log or event stream.
fn marker_nowhere(
    ctx: &Ctx<'_>,
    probes: &[&Probe<'_>],
    marker: &str,
    out: &mut Outcome,
) -> Result<(), HostError> {
    let mut holders = ctx.host.files_holding(marker.as_bytes())?;
    match ctx.host.metrics_with(None) {
        Ok(text) if text.contains(marker) => holders.push("the metrics (GET /v1/metrics)".into()),
        Ok(_) => {}
        Err(e) => out
            .findings
            .push(format!("the admin's metrics could not be read: {e}")),
    }
    for p in probes {
        for stream in STREAMS {
            if let Ok(text) = ctx.host.logs_with(&p.name, &p.token, stream) {
                if text.contains(marker) {
                    holders.push(format!("{}'s {stream:?} log", p.name));
                }
            }
        }
    }
    out.add("places_with_marker", holders.len() as f64, "count");
    if !holders.is_empty() {
        out.verdict = Verdict::Fail;
        out.findings.push(format!(
            "the marker prompt is readable in plaintext in: {}",
            holders.join(", ")
        ));
    }
    Ok(())
}
