//! The GPU halves of checks 4 and 10 against the fake host with GPUs: each passes on a
//! healthy simulated GPU host, fails on the host broken the way it must catch (a MIG
//! instance, a VF type, a vfio binding or a reservation left behind, a skipped scrub, an
//! unrecorded quarantine, GPU memory past the slice), and is inconclusive where it cannot
//! see (a blind GPU view, no free slice, no CUDA driver in the guest).

use std::time::Duration;

use super::fake::{Broken, FakeVerifyHost};
use super::gpu_probe::{choose_slice, GpuPlan, GpuProbes};
use super::host::GpuView;
use super::probe::PROBE_PREFIX;
use super::*;
use crate::api::types::GpuSlice;
use crate::domain::spec::GpuRequest;

fn gpu(index: &str, key: &str) -> GpuView {
    GpuView {
        index: index.into(),
        pci_address: format!("0000:{index:0>2}:00.0"),
        name: key.into(),
        model: tenantvm_gpu::mig::model_by_key(key).unwrap(),
    }
}

fn config() -> VerifyConfig {
    VerifyConfig {
        probe_image: Some("ngram".into()),
        latency_samples: 10,
        ..VerifyConfig::default()
    }
}

fn run(host: &FakeVerifyHost, cfg: &VerifyConfig, id: CheckId) -> CheckResult {
    let probes = Probes::new(
        host,
        "0badc0de",
        cfg.probe_image.clone(),
        cfg.probe_memory_mib,
        None,
        Duration::from_secs(5),
    );
    let r = run_checks(host, &probes, cfg, 42, &[id]).remove(0);
    assert!(
        !host.names().iter().any(|n| n.starts_with(PROBE_PREFIX)),
        "probes left"
    );
    r
}

fn host(broken: Broken, gpus: &[(&str, &str)]) -> FakeVerifyHost {
    let mut h = FakeVerifyHost::new(broken);
    h.gpus = gpus.iter().map(|(i, k)| gpu(i, k)).collect();
    h
}

const H100: &[(&str, &str)] = &[("15", "h100-80gb")];

fn departure(broken: Broken, gpus: &[(&str, &str)]) -> CheckResult {
    run(&host(broken, gpus), &config(), CheckId::Departure)
}

#[test]
fn the_smallest_slice_is_asked_for_and_a_full_host_says_so() {
    match choose_slice(&[gpu("0", "a100-40gb"), gpu("1", "h100-80gb")], &[]) {
        GpuPlan::Ask(r) => assert_eq!(r.profile.as_deref(), Some("1g.5gb")),
        other => panic!("{other:?}"),
    }
    match choose_slice(&[gpu("2", "l40s")], &[]) {
        GpuPlan::Ask(r) => assert!(r.whole_gpu && r.profile.is_none()),
        other => panic!("{other:?}"),
    }
    let mut holder = super::fake::view_of(
        &crate::domain::spec::TenantSpec {
            name: crate::domain::TenantName::new("real").unwrap(),
            vcpus: 1,
            memory_mib: 128,
            disk_gib: 0,
            gpu: GpuRequest::default(),
            image: Default::default(),
            quotas: Default::default(),
            hugepages: None,
            vgpu_licence: None,
        },
        1,
    );
    holder.gpu = Some(GpuSlice {
        gpu: "0000:02:00.0".into(),
        slots: vec![0],
        label: "whole".into(),
    });
    assert!(matches!(
        choose_slice(&[gpu("2", "l40s")], std::slice::from_ref(&holder)),
        GpuPlan::NoSlice(_)
    ));
    // GPU tenants but no backend named: not silently "no GPU".
    assert!(matches!(choose_slice(&[], &[holder]), GpuPlan::NoSlice(_)));
    assert!(matches!(choose_slice(&[], &[]), GpuPlan::NotRun(_)));
    assert_eq!("off".parse::<GpuProbes>(), Ok(GpuProbes::Off));
    "sometimes".parse::<GpuProbes>().unwrap_err();
}

#[test]
fn check_10_passes_on_a_healthy_simulated_gpu_host() {
    let r = departure(Broken::default(), H100);
    assert_eq!(r.outcome.verdict, Verdict::Pass, "{r:#?}");
    let v = |m: &str| r.outcome.value(m).unwrap_or_else(|| panic!("{m}: {r:#?}"));
    assert_eq!(v("gpu_probe"), 1.0);
    assert_eq!(v("gpu_seen_while_running_reservations"), 1.0);
    assert_eq!(v("gpu_seen_while_running_instances"), 1.0);
    assert_eq!(v("gpu_seen_while_running_vf_types"), 1.0);
    assert_eq!(v("gpu_receipt_steps_simulated"), 3.0);
    for m in [
        "gpu_left_mig_instances",
        "gpu_left_reservations",
        "gpu_left_vf_types",
        "gpu_left_vfio_bound",
        "gpu_quarantined",
    ] {
        assert_eq!(v(m), 0.0, "{m}");
    }
    // A whole non-MIG card, handed back.
    let r = departure(Broken::default(), &[("41", "l40s")]);
    assert_eq!(r.outcome.verdict, Verdict::Pass, "{r:#?}");
    assert!(r
        .outcome
        .findings
        .iter()
        .any(|f| f.contains("0000:41:00.0/whole")));
}

#[test]
fn check_10_fails_on_each_gpu_leftover() {
    for (broken, measure) in [
        (
            Broken {
                gpu_instance_left: true,
                ..Broken::default()
            },
            "gpu_left_mig_instances",
        ),
        (
            Broken {
                vf_type_left: true,
                ..Broken::default()
            },
            "gpu_left_vf_types",
        ),
        (
            Broken {
                vfio_left_bound: true,
                ..Broken::default()
            },
            "gpu_left_vfio_bound",
        ),
        (
            Broken {
                reservation_left: true,
                ..Broken::default()
            },
            "gpu_left_reservations",
        ),
    ] {
        let r = departure(broken, H100);
        assert_eq!(r.outcome.verdict, Verdict::Fail, "{broken:?}: {r:#?}");
        assert_eq!(r.outcome.value(measure), Some(1.0), "{broken:?}: {r:#?}");
        assert!(
            r.outcome.findings.iter().any(|f| f.contains("left behind")),
            "{r:#?}"
        );
    }
    // A whole card left on vfio-pci.
    let r = departure(
        Broken {
            vfio_left_bound: true,
            ..Broken::default()
        },
        &[("41", "l40s")],
    );
    assert_eq!(r.outcome.verdict, Verdict::Fail, "{r:#?}");
}

#[test]
fn check_10_judges_the_receipts_gpu_steps_and_quarantine_honestly() {
    let r = departure(
        Broken {
            gpu_scrub_skipped: true,
            ..Broken::default()
        },
        H100,
    );
    assert_eq!(r.outcome.verdict, Verdict::Fail, "{r:#?}");
    assert!(r.outcome.findings.iter().any(|f| f.contains("GpuScrub")));
    // Quarantined, as the receipt says: the device kept bound is excused, the check passes.
    let r = departure(
        Broken {
            gpu_quarantined: true,
            ..Broken::default()
        },
        H100,
    );
    assert_eq!(r.outcome.verdict, Verdict::Pass, "{r:#?}");
    assert_eq!(r.outcome.value("gpu_quarantined"), Some(1.0));
    // Quarantined without the receipt saying so.
    let r = departure(
        Broken {
            quarantine_unrecorded: true,
            ..Broken::default()
        },
        H100,
    );
    assert_eq!(r.outcome.verdict, Verdict::Fail, "{r:#?}");
}

#[test]
fn check_10_gpu_half_is_inconclusive_when_blind_or_full_and_absent_when_off() {
    let r = departure(
        Broken {
            gpu_view_blind: true,
            ..Broken::default()
        },
        H100,
    );
    assert_eq!(r.outcome.verdict, Verdict::Inconclusive, "{r:#?}");
    let r = departure(
        Broken {
            gpu_full: true,
            ..Broken::default()
        },
        H100,
    );
    assert_eq!(r.outcome.verdict, Verdict::Inconclusive, "{r:#?}");
    assert!(
        r.outcome
            .findings
            .iter()
            .any(|f| f.contains("no GPU slice")),
        "{r:#?}"
    );
    assert_eq!(r.outcome.value("gpu_probe"), Some(0.0));
    let cfg = VerifyConfig {
        gpu_probes: GpuProbes::Off,
        ..config()
    };
    let r = run(
        &host(
            Broken {
                gpu_instance_left: true,
                ..Broken::default()
            },
            H100,
        ),
        &cfg,
        CheckId::Departure,
    );
    assert_eq!(r.outcome.verdict, Verdict::Pass, "{r:#?}");
    assert_eq!(r.outcome.value("gpu_probe"), Some(0.0));
}

fn memory(broken: Broken) -> CheckResult {
    run(&host(broken, H100), &config(), CheckId::MemoryPartition)
}

#[test]
fn check_4_gpu_half_passes_when_allocation_stops_at_the_slice() {
    let r = memory(Broken::default());
    assert_eq!(r.outcome.verdict, Verdict::Pass, "{r:#?}");
    let slice = r.outcome.value("gpu_slice_mib").unwrap();
    let got = r.outcome.value("gpu_allocated_mib").unwrap();
    let smallest = tenantvm_gpu::mig::model_by_key("h100-80gb")
        .unwrap()
        .profile("1g.10gb")
        .unwrap()
        .memory_mib;
    assert_eq!(slice, smallest as f64, "1g.10gb of an H100 80GB");
    assert!(got > 0.0 && got <= slice, "{r:#?}");
    assert!(
        r.outcome.value("gpu_neighbour_p50_ratio").is_some(),
        "{r:#?}"
    );
}

#[test]
fn check_4_gpu_half_fails_past_the_slice_and_is_inconclusive_without_cuda_or_a_slice() {
    let r = memory(Broken {
        gpu_memory_unbounded: true,
        ..Broken::default()
    });
    assert_eq!(r.outcome.verdict, Verdict::Fail, "{r:#?}");
    assert!(
        r.outcome.value("gpu_allocated_mib").unwrap()
            > r.outcome.value("gpu_slice_mib").unwrap()
                + r.outcome.value("gpu_tolerance_mib").unwrap()
    );
    let r = memory(Broken {
        no_cuda_in_guest: true,
        ..Broken::default()
    });
    assert_eq!(r.outcome.verdict, Verdict::Inconclusive, "{r:#?}");
    assert!(
        r.outcome
            .findings
            .iter()
            .any(|f| f.contains("no CUDA driver in the guest")),
        "{r:#?}"
    );
    let r = memory(Broken {
        gpu_full: true,
        ..Broken::default()
    });
    assert_eq!(r.outcome.verdict, Verdict::Inconclusive, "{r:#?}");
}

/// A receipt with `steps`, as the audit log holds it.
fn receipt(steps: Vec<crate::receipt::StepRecord>) -> Vec<crate::receipt::LogEntry> {
    vec![crate::receipt::LogEntry {
        seq: 0,
        prev_hash: String::new(),
        appended_at: String::new(),
        key_id: String::new(),
        receipt: crate::receipt::Receipt {
            version: crate::receipt::RECEIPT_VERSION,
            departure_id: "p-1".into(),
            tenant: "p".into(),
            started_at: String::new(),
            finished_at: String::new(),
            steps,
            verification: None,
        },
        signature: String::new(),
    }]
}

fn gpu_step(
    step: crate::receipt::DepartureStep,
    result: crate::receipt::StepResult,
    assurance: crate::receipt::Assurance,
) -> crate::receipt::StepRecord {
    crate::receipt::StepRecord::new(
        step,
        "test",
        result,
        assurance,
        "2026-01-01T00:00:00Z".into(),
        "2026-01-01T00:00:01Z".into(),
    )
}

#[test]
fn a_missing_gpu_step_and_a_quarantine_the_daemon_does_not_list_fail() {
    use super::checks::gpu_departure::{judge_gpu_departure, GpuSnapshot};
    use crate::receipt::{Assurance, DepartureStep, StepResult};
    let slice = GpuSlice {
        gpu: "0000:18:00.0".into(),
        slots: vec![0],
        label: "1g.10gb@0".into(),
    };
    let before = GpuSnapshot::default();
    let mut during = GpuSnapshot::default();
    during.reservations.insert("0000:18:00.0/1g.10gb@0".into());
    let after = GpuSnapshot::default();
    let ok = |s| gpu_step(s, StepResult::Ok, Assurance::Verified);
    let judge = |steps| {
        let mut out = Outcome::new(Verdict::Pass);
        judge_gpu_departure(
            &mut out,
            "p",
            &slice,
            &before,
            &during,
            &after,
            &receipt(steps),
        );
        out
    };
    // A verified scrub that covered its 1g.10gb slice, less the driver's share.
    let slice_bytes = 9_984u64 << 20;
    let scrubbed = |bytes: u64| {
        let mut s = ok(DepartureStep::GpuScrub);
        for (k, v) in [
            ("total_bytes", slice_bytes),
            ("held_bytes", 300 << 20),
            ("scrubbed_bytes", bytes),
            ("slice_bytes", slice_bytes),
        ] {
            s = s.with_evidence(k, v);
        }
        s
    };
    // All three verified: pass, as the control for the ones below.
    let out = judge(vec![
        ok(DepartureStep::DeviceReset),
        scrubbed(slice_bytes - (300 << 20)),
        ok(DepartureStep::GpuRelease),
    ]);
    assert_eq!(out.verdict, Verdict::Pass, "{out:#?}");
    assert_eq!(out.value("gpu_receipt_steps_verified"), Some(3.0));
    // A scrub receipted verified at a quarter of its slice.
    let out = judge(vec![
        ok(DepartureStep::DeviceReset),
        scrubbed(slice_bytes / 4),
        ok(DepartureStep::GpuRelease),
    ]);
    assert_eq!(out.verdict, Verdict::Fail, "{out:#?}");
    assert!(
        out.findings
            .iter()
            .any(|f| f.contains("did not cover the slice")),
        "{out:#?}"
    );
    // A scrub receipted verified without its counts shows nothing.
    let out = judge(vec![
        ok(DepartureStep::DeviceReset),
        ok(DepartureStep::GpuScrub),
        ok(DepartureStep::GpuRelease),
    ]);
    assert_eq!(out.verdict, Verdict::Fail, "{out:#?}");
    // No GpuRelease step.
    let out = judge(vec![
        ok(DepartureStep::DeviceReset),
        scrubbed(slice_bytes - (300 << 20)),
    ]);
    assert_eq!(out.verdict, Verdict::Fail, "{out:#?}");
    assert!(out
        .findings
        .iter()
        .any(|f| f.contains("no GpuRelease step")));
    // The scrub says it quarantined the slice; the daemon does not list it.
    let out = judge(vec![
        ok(DepartureStep::DeviceReset),
        gpu_step(
            DepartureStep::GpuScrub,
            StepResult::Failed,
            Assurance::Unverified,
        )
        .with_evidence("quarantined", true),
        ok(DepartureStep::GpuRelease),
    ]);
    assert_eq!(out.verdict, Verdict::Fail, "{out:#?}");
    assert!(out
        .findings
        .iter()
        .any(|f| f.contains("does not list it as quarantined")));
}

fn noisy(broken: Broken, gpus: &[(&str, &str)]) -> CheckResult {
    let cfg = VerifyConfig {
        gpu_compute_seconds: 1,
        ..config()
    };
    run(&host(broken, gpus), &cfg, CheckId::NoisyNeighbour)
}

#[test]
fn check_8_gpu_half_measures_the_victims_compute_beside_a_saturated_slice() {
    let r = noisy(Broken::default(), H100);
    assert_eq!(r.outcome.verdict, Verdict::Pass, "{r:#?}");
    let idle = r.outcome.value("gpu_victim_idle_mfma_per_s").unwrap();
    let loaded = r.outcome.value("gpu_victim_loaded_mfma_per_s").unwrap();
    assert!(idle > 0.0 && loaded > 0.0, "{r:#?}");
    assert!(
        r.outcome.value("gpu_victim_slowdown").unwrap() < 1.5,
        "{r:#?}"
    );
    assert!(r.outcome.value("gpu_noisy_mfma").unwrap() > 0.0, "{r:#?}");
    let slices = r
        .outcome
        .findings
        .iter()
        .filter(|f| f.contains("holds GPU slice"))
        .count();
    assert_eq!(slices, 2, "{r:#?}");
    // Slices that share compute: the victim slows down with its neighbour, and the check
    // fails, whatever its CPU half says.
    let r = noisy(
        Broken {
            gpu_compute_shared: true,
            ..Broken::default()
        },
        H100,
    );
    assert_eq!(r.outcome.verdict, Verdict::Fail, "{r:#?}");
    assert!(
        r.outcome.value("gpu_victim_slowdown").unwrap() > 2.0,
        "{r:#?}"
    );
    assert!(
        r.outcome
            .findings
            .iter()
            .any(|f| f.contains("the slices share compute")),
        "{r:#?}"
    );
}

#[test]
fn check_8_gpu_half_is_not_applicable_without_a_gpu_and_inconclusive_when_it_cannot_run() {
    // No GPU: the CPU half decides, and the report says the GPU half does not apply.
    let r = noisy(Broken::default(), &[]);
    assert_eq!(r.outcome.verdict, Verdict::Pass, "{r:#?}");
    assert!(r.outcome.value("gpu_victim_slowdown").is_none());
    assert!(
        r.outcome
            .findings
            .iter()
            .any(|f| f.starts_with("GPU half not applicable")),
        "{r:#?}"
    );
    for broken in [
        Broken {
            no_cuda_in_guest: true,
            ..Broken::default()
        },
        Broken {
            gpu_full: true,
            ..Broken::default()
        },
    ] {
        let r = noisy(broken, H100);
        assert_eq!(r.outcome.verdict, Verdict::Inconclusive, "{r:#?}");
        assert!(r.outcome.value("gpu_victim_slowdown").is_none(), "{r:#?}");
    }
    // The judgement alone: a 1.2x slowdown passes, 4x fails, no rate under load fails.
    let mut o = Outcome::new(Verdict::Pass);
    super::checks::noisy_gpu::judge_slowdown(&mut o, "v", 1200.0, 1000.0, 3.0);
    assert_eq!(o.verdict, Verdict::Pass);
    super::checks::noisy_gpu::judge_slowdown(&mut o, "v", 4000.0, 1000.0, 3.0);
    assert_eq!(o.verdict, Verdict::Fail);
    let mut o = Outcome::new(Verdict::Pass);
    super::checks::noisy_gpu::judge_slowdown(&mut o, "v", 4000.0, 0.0, 3.0);
    assert_eq!(o.verdict, Verdict::Fail);
}
