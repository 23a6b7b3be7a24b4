//! The departure building blocks survive a crash anywhere: GPU scrub (simulated backend),
//! crypto-shred and the receipt append, re-run from the last persisted progress as the daemon's
//! lifecycle does on restart, always end with the image and key gone and exactly one receipt
//! in an intact audit log.
//!
//! The progress file here stands in for the lifecycle's store: a step's record is persisted
//! right after the step, and the receipt is appended last.

use std::fs;
use std::path::{Path, PathBuf};

use tenantvm::disk::{create_image, crypto_shred, KeyslotCost};
use tenantvm::gpu::scrub::simulate_scrub;
use tenantvm::keys::{HostKek, KekSource, KeyStore};
use tenantvm::receipt::{
    new_departure_id, now_rfc3339, AuditLog, Receipt, ReceiptSigner, StepResult,
};

const TENANT: &str = "leaver";

/// The points a crash can hit, in order.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
enum Point {
    AfterScrub,
    AfterScrubPersisted,
    AfterShred,
    AfterShredPersisted,
    AfterAppend,
    Never,
}

struct Host {
    _dir: tempfile::TempDir,
    keys: KeyStore,
    image: PathBuf,
    progress: PathBuf,
    log: AuditLog,
    signer: ReceiptSigner,
}

fn host() -> Host {
    let dir = tempfile::tempdir().unwrap();
    let kek = HostKek::load(&KekSource::File(dir.path().join("kek"))).unwrap();
    let keys = KeyStore::new(&dir.path().join("keys"), kek).unwrap();
    let image = dir.path().join("leaver.img");
    let key = keys.create(TENANT).unwrap();
    create_image(&image, 20 << 20, &key, KeyslotCost::TEST).unwrap();
    let signer = ReceiptSigner::load_or_create(&dir.path().join("receipt.key")).unwrap();
    let log = AuditLog::new(&dir.path().join("receipts.jsonl"));
    let progress = dir.path().join("departure.json");
    Host {
        _dir: dir,
        keys,
        image,
        progress,
        log,
        signer,
    }
}

fn persist(path: &Path, receipt: &Receipt) {
    fs::write(path, serde_json::to_vec(receipt).unwrap()).unwrap();
}

/// Runs (or resumes) the departure; returns false where `crash` cuts it short.
fn depart(h: &Host, crash: Point) -> bool {
    let mut receipt: Receipt = match fs::read(&h.progress) {
        Ok(data) => serde_json::from_slice(&data).unwrap(),
        Err(_) => {
            let r = Receipt::begin(&new_departure_id(TENANT), TENANT);
            persist(&h.progress, &r);
            r
        }
    };
    let done = |r: &Receipt, step| {
        r.steps
            .iter()
            .any(|s| s.step == step && s.result == StepResult::Ok)
    };

    if !done(&receipt, tenantvm::receipt::DepartureStep::GpuScrub) {
        let started = now_rfc3339();
        let outcome = simulate_scrub("sim-gpu0", 80 << 30, false);
        let record = outcome.step_record(started, now_rfc3339());
        if crash == Point::AfterScrub {
            return false;
        }
        receipt.record(record);
        persist(&h.progress, &receipt);
        if crash == Point::AfterScrubPersisted {
            return false;
        }
    }
    if !done(&receipt, tenantvm::receipt::DepartureStep::CryptoShred) {
        let started = now_rfc3339();
        let report = crypto_shred(&h.keys, TENANT, &h.image).unwrap();
        let record = report.step_record(started, now_rfc3339());
        if crash == Point::AfterShred {
            return false;
        }
        receipt.record(record);
        persist(&h.progress, &receipt);
        if crash == Point::AfterShredPersisted {
            return false;
        }
    }
    h.log.append(&h.signer, &receipt).unwrap();
    if crash == Point::AfterAppend {
        return false;
    }
    fs::remove_file(&h.progress).unwrap();
    true
}

#[test]
fn departure_killed_at_any_point_resumes_to_one_receipt() {
    for crash in [
        Point::AfterScrub,
        Point::AfterScrubPersisted,
        Point::AfterShred,
        Point::AfterShredPersisted,
        Point::AfterAppend,
        Point::Never,
    ] {
        let h = host();
        let finished_first_time = depart(&h, crash);
        assert_eq!(finished_first_time, crash == Point::Never, "{crash:?}");
        if !finished_first_time {
            // The restarted daemon resumes from the persisted progress.
            assert!(depart(&h, Point::Never), "{crash:?}");
        }

        assert!(!h.image.exists(), "{crash:?}: image left");
        assert!(
            !h.keys.exists(TENANT).unwrap(),
            "{crash:?}: wrapped key left"
        );
        let report = h.log.verify(&h.signer.verifying_key()).unwrap();
        assert!(report.is_intact(), "{crash:?}: {:?}", report.problems);
        let entries = h.log.entries().unwrap();
        assert_eq!(entries.len(), 1, "{crash:?}: receipts {}", entries.len());
        let receipt = &entries[0].receipt;
        assert!(receipt.succeeded() && receipt.simulated(), "{crash:?}");
        assert_eq!(receipt.steps.len(), 2, "{crash:?}");
        let shred = &receipt.steps[1];
        // A shred re-run after its first run's report was lost finds the work done and says
        // so; otherwise the record carries the header evidence.
        if crash == Point::AfterShred {
            assert_eq!(shred.evidence["image_deleted"], "true");
        } else {
            assert_eq!(shred.evidence["old_key_rejected"], "true", "{crash:?}");
        }
    }
}
