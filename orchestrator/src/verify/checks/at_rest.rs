//! Check 9: tenant data is separated at rest with per-tenant keys. Two probe tenants with
//! disks: each disk image must be LUKS2 from its first byte (a plaintext disk fails), each
//! must have a wrapped key of its own (the sealed format, distinct between tenants), and a
//! marker sent to each tenant's payload (which keeps its request history on its data disk)
//! must appear in no host file in plaintext.
//!
//! A marker *model* (a file whose bytes repeat a marker) is pushed to each probe with model
//! push, and the plaintext scan must not find it, after a positive control: the same scan
//! finds the marker in a plaintext copy written where it looks.
//!
//! Each disk must open only with its own key: the other probe's key is tried against it
//! (a keyslot check, nothing mapped) and must fail, after the positive control that its
//! own key opens it (else inconclusive). The live host tries keys against a private
//! snapshot of the header, and only when every keyslot's KDF cost is within what the
//! daemon writes (a guest-written header is hostile input, [`crate::verify::cross_key`]).

use crate::verify::{Check, CheckId, Ctx, HostError, Outcome, Verdict};

/// The LUKS2 header's first bytes: magic and version 2.
const LUKS2_MAGIC: &[u8] = b"LUKS\xba\xbe\x00\x02";
/// The sealed key file's first bytes ([`crate::keys`]).
const WRAP_MAGIC: &[u8] = b"TVMWK1\0\0";

/// Judges one tenant's disk header and wrapped key.
pub fn judge_disk(out: &mut Outcome, name: &str, header: Option<&[u8]>, key: Option<&[u8]>) {
    match header {
        None => {
            out.verdict = Verdict::Fail;
            out.findings
                .push(format!("{name}: asked for a disk but has no disk image"));
        }
        Some(h) if !h.starts_with(LUKS2_MAGIC) => {
            out.verdict = Verdict::Fail;
            out.findings.push(format!(
                "{name}: its disk image is not LUKS2 (first bytes {}): it is stored in plaintext",
                hex::encode(&h[..h.len().min(8)])
            ));
        }
        Some(_) => {}
    }
    match key {
        None => {
            out.verdict = Verdict::Fail;
            out.findings
                .push(format!("{name}: has no wrapped disk key of its own"));
        }
        Some(k) if !k.starts_with(WRAP_MAGIC) || k.len() != crate::keys::WRAPPED_BYTES => {
            out.verdict = Verdict::Fail;
            out.findings.push(format!(
                "{name}: its key file is not a sealed key ({} bytes): the disk key may be stored raw",
                k.len()
            ));
        }
        Some(_) => {}
    }
}

/// A marker model: 64 KiB of the marker repeated, so that it spans many disk blocks.
pub fn marker_model(marker: &str) -> Vec<u8> {
    let line = format!("{marker}\n");
    line.repeat((64 << 10) / line.len() + 1).into_bytes()
}

/// A marker no real file holds by chance.
pub fn new_marker(kind: &str) -> String {
    format!("tvm-verify-{kind}-marker-{:016x}", rand::random::<u64>())
}

impl Check for WeightsAtRestCheck {
    fn id(&self) -> CheckId {
        CheckId::WeightsAtRest
    }

    fn run(&self, ctx: &Ctx<'_>) -> Result<Outcome, HostError> {
        let a = ctx.probes.create("rest", |s| s.disk_gib = 1)?;
        let b = ctx.probes.create("rest", |s| s.disk_gib = 1)?;
        let mut out = Outcome::new(Verdict::Pass);
        let mut keys = Vec::new();
        for p in [&a, &b] {
            let header = ctx.host.disk_header(&p.name)?;
            let key = ctx.host.wrapped_key(&p.name)?;
            judge_disk(&mut out, &p.name, header.as_deref(), key.as_deref());
            keys.push(key);
        }
        if let (Some(ka), Some(kb)) = (&keys[0], &keys[1]) {
            if ka == kb {
                out.verdict = Verdict::Fail;
                out.findings.push(format!(
                    "{} and {} have the same sealed key",
                    a.name, b.name
                ));
            }
        }
        let marker = new_marker("rest");
        let mut sent = 0;
        for p in [&a, &b] {
            match ctx
                .host
                .complete(&p.name, &p.token, &format!("{marker} {marker}"), 4)
            {
                Ok(_) => sent += 1,
                Err(e) => out
                    .findings
                    .push(format!("{}: marker not sent: {e}", p.name)),
            }
        }
        out.add("markers_sent", f64::from(sent), "count");
        let model = marker_model(&marker);
        let mut pushed = 0;
        for p in [&a, &b] {
            match ctx
                .host
                .push_model(&p.name, &p.token, "tvm-verify-marker", &model)
            {
                Ok(()) => pushed += 1,
                Err(e) => out
                    .findings
                    .push(format!("{}: marker model not pushed: {e}", p.name)),
            }
        }
        out.add("marker_models_pushed", f64::from(pushed), "count");
        // Positive control: the scan finds the marker in a plaintext copy of the model.
        let control = ctx.host.scan_finds(&model, marker.as_bytes())?;
        out.add(
            "control_found_plaintext_copy",
            f64::from(u8::from(control)),
            "bool",
        );
        if !control {
            out.verdict = Verdict::Inconclusive;
            out.findings.push(
                "control: the scan did not find the marker in a plaintext copy: its silence proves nothing"
                    .into(),
            );
        }
        let holders = ctx.host.files_holding(marker.as_bytes())?;
        out.add("host_files_with_marker", holders.len() as f64, "count");
        if !holders.is_empty() {
            out.verdict = Verdict::Fail;
            out.findings.push(format!(
                "the marker is readable in plaintext in: {}",
                holders.join(", ")
            ));
        }
        if sent + pushed == 0 && out.verdict == Verdict::Pass {
            out.verdict = Verdict::Inconclusive;
            out.findings
                .push("no marker reached a tenant: the plaintext scan proves nothing".into());
        }
        judge_cross_keys(ctx, &mut out, &a.name, &b.name);
        Ok(out)
    }
}

/// Check 9.
pub struct WeightsAtRestCheck;

/// Each disk with its own key (the control: must open) and with the other's (must not).
fn judge_cross_keys(ctx: &Ctx<'_>, out: &mut Outcome, a: &str, b: &str) {
    let mut cross_opened = 0;
    let mut own_opened = 0;
    let mut tried = 0;
    for (disk, other) in [(a, b), (b, a)] {
        let own = ctx.host.disk_opens_with(disk, disk);
        let cross = ctx.host.disk_opens_with(disk, other);
        match (own, cross) {
            (Ok(own), Ok(cross)) => {
                tried += 1;
                own_opened += u32::from(own);
                cross_opened += u32::from(cross);
                if cross {
                    out.verdict = Verdict::Fail;
                    out.findings.push(format!(
                        "{disk}'s disk opens with {other}'s key: the tenants' keys are not separate"
                    ));
                }
                if !own {
                    if out.verdict == Verdict::Pass {
                        out.verdict = Verdict::Inconclusive;
                    }
                    out.findings.push(format!(
                        "control: {disk}'s disk does not open even with its own key, so the cross-key refusal proves nothing"
                    ));
                }
            }
            (Err(e), _) | (_, Err(e)) => {
                if out.verdict == Verdict::Pass {
                    out.verdict = Verdict::Inconclusive;
                }
                out.findings
                    .push(format!("{disk}: keys not tried against its disk: {e}"));
            }
        }
    }
    out.add("disks_tried_with_keys", f64::from(tried), "count");
    out.add("disks_opened_by_own_key", f64::from(own_opened), "count");
    out.add(
        "disks_opened_by_other_key",
        f64::from(cross_opened),
        "count",
    );
    if tried == 2 && own_opened == 2 && cross_opened == 0 {
        out.findings.push(format!(
            "each disk opens with its own key and not with the other's ({a}, {b})"
        ));
    }
}
