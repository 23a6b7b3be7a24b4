//! The checks against the fake host: each passes on a healthy host and fails on the host
//! broken the way issue 16 lists; and the framework: selection, probe names, cleanup
//! whatever happens, the ledger sweep, the report and its signed audit-log entry.

use std::time::Duration;

use super::checks::*;
use super::fake::{view_of, Broken, FakeEngine, FakeVerifyHost};
use super::host::{Engine, GpuView, VerifyHost};
use super::probe::{looks_like_probe, probe_name, PROBE_PREFIX};
use super::*;
use crate::api::types::GpuSlice;
use crate::domain::spec::{GpuRequest, GuestImage, Quotas, TenantSpec};
use crate::domain::TenantName;

fn config() -> VerifyConfig {
    VerifyConfig {
        probe_image: Some("ngram".into()),
        samples_per_arm: 40,
        prefix_words: 60,
        latency_samples: 10,
        ..VerifyConfig::default()
    }
}

/// Runs `id` on `host`; checks that no probe tenant is left afterwards.
fn run_one(host: &FakeVerifyHost, cfg: &VerifyConfig, id: CheckId) -> CheckResult {
    let probes = Probes::new(
        host,
        "0badc0de",
        cfg.probe_image.clone(),
        cfg.probe_memory_mib,
        None,
        Duration::from_secs(5),
    );
    let mut results = run_checks(host, &probes, cfg, 42, &[id]);
    let leftover: Vec<String> = host
        .names()
        .into_iter()
        .filter(|n| n.starts_with(PROBE_PREFIX))
        .collect();
    assert!(leftover.is_empty(), "probes left: {leftover:?}");
    results.remove(0)
}

fn verdict(broken: Broken, id: CheckId) -> (Verdict, CheckResult) {
    let host = FakeVerifyHost::new(broken);
    let r = run_one(&host, &config(), id);
    (r.outcome.verdict, r)
}

fn assert_pass_then_fail(id: CheckId, broken: Broken) {
    let (v, r) = verdict(Broken::default(), id);
    assert_eq!(v, Verdict::Pass, "healthy host: {r:#?}");
    let (v, r) = verdict(broken, id);
    assert_eq!(v, Verdict::Fail, "broken host: {r:#?}");
}

#[test]
fn check_1_threat_model_missing_fails_and_written_passes() {
    let host = FakeVerifyHost::new(Broken::default());
    let mut cfg = config();
    assert_eq!(
        run_one(&host, &cfg, CheckId::ThreatModel).outcome.verdict,
        Verdict::Fail
    );
    let dir = tempfile::tempdir().unwrap();
    let short = dir.path().join("short.md");
    std::fs::write(&short, "tenants are bad").unwrap();
    cfg.threat_model = Some(short);
    let r = run_one(&host, &cfg, CheckId::ThreatModel);
    assert_eq!(r.outcome.verdict, Verdict::Fail, "{r:#?}");
    let good = dir.path().join("tm.md");
    std::fs::write(
        &good,
        "Tenants are three competing banks. Each must not learn another's prompts, weights, \
         outputs, timing of requests, or whether another sent a given prompt. The host \
         operator is trusted.",
    )
    .unwrap();
    cfg.threat_model = Some(good);
    let r = run_one(&host, &cfg, CheckId::ThreatModel);
    assert_eq!(r.outcome.verdict, Verdict::Pass, "{r:#?}");
    assert!(r.outcome.value("threat_model_words").unwrap() >= 20.0);
}

fn spec(name: &str, gpu: GpuRequest) -> TenantSpec {
    TenantSpec {
        name: TenantName::new(name).unwrap(),
        vcpus: 1,
        memory_mib: 128,
        disk_gib: 0,
        gpu,
        image: GuestImage {
            name: Some("ngram".into()),
            ..GuestImage::default()
        },
        quotas: Quotas::default(),
        hugepages: None,
        vgpu_licence: None,
    }
}

fn tenant_on(
    name: &str,
    gpu: GpuRequest,
    slice: (&str, Vec<u32>, &str),
) -> crate::api::types::TenantView {
    let mut v = view_of(&spec(name, gpu), 1);
    v.gpu = Some(GpuSlice {
        gpu: slice.0.into(),
        slots: slice.1,
        label: slice.2.into(),
    });
    v
}

fn gpu(index: &str, key: &str) -> GpuView {
    GpuView {
        index: index.into(),
        pci_address: format!("0000:{index:0>2}:00.0"),
        name: key.into(),
        model: tenantvm_gpu::mig::model_by_key(key).unwrap(),
    }
}

#[test]
fn check_2_a_non_mig_sku_shared_by_two_tenants_fails() {
    let mig = |p: &str| GpuRequest {
        profile: Some(p.into()),
        ..Default::default()
    };
    let tenants = vec![
        tenant_on("a", mig("1g.10gb"), ("0", vec![0], "1g.10gb@0")),
        tenant_on("b", mig("1g.10gb"), ("0", vec![1], "1g.10gb@1")),
    ];
    let ok = gpu::judge_mig_sku(&tenants, &[gpu("0", "h100-80gb")], &[]);
    assert_eq!(ok.verdict, Verdict::Pass, "{ok:#?}");
    assert_eq!(ok.value("gpus_shared"), Some(1.0));
    let l40s = vec![
        tenant_on(
            "a",
            GpuRequest {
                whole_gpu: true,
                ..Default::default()
            },
            ("0", vec![0], "whole"),
        ),
        tenant_on(
            "b",
            GpuRequest {
                whole_gpu: true,
                ..Default::default()
            },
            ("0", vec![0], "whole"),
        ),
    ];
    let bad = gpu::judge_mig_sku(&l40s, &[gpu("0", "l40s")], &[]);
    assert_eq!(bad.verdict, Verdict::Fail, "{bad:#?}");
    assert!(bad.findings[0].contains("no MIG"), "{bad:#?}");
    // Shares held but no GPU list to judge them by: never a pass.
    assert_eq!(
        gpu::judge_mig_sku(&tenants, &[], &[]).verdict,
        Verdict::Inconclusive
    );
    // The check reads both through the host.
    let host = FakeVerifyHost::with_gpus(vec![gpu("0", "l40s")]);
    for t in l40s {
        host.add_tenant(t.spec.clone(), t.gpu.clone());
    }
    assert_eq!(
        run_one(&host, &config(), CheckId::MigSku).outcome.verdict,
        Verdict::Fail
    );
}

/// With no GPU tenant checks 2 and 3 judge nothing: not applicable, never a pass, and the
/// report's headline names them.
#[test]
fn checks_2_and_3_without_gpu_tenants_are_not_applicable_and_the_headline_says_so() {
    let host = FakeVerifyHost::new(Broken::default());
    for id in [CheckId::MigSku, CheckId::PartitionArithmetic] {
        let r = run_one(&host, &config(), id);
        assert_eq!(r.outcome.verdict, Verdict::NotApplicable, "{r:#?}");
        assert!(r.outcome.findings[0].contains("not a pass"), "{r:#?}");
    }
    let cfg = config();
    let probes = Probes::new(&host, "0badc0de", None, 128, None, Duration::from_secs(5));
    let checks = run_checks(
        &host,
        &probes,
        &cfg,
        42,
        &[CheckId::MigSku, CheckId::PartitionArithmetic],
    );
    // Nothing passed: the run does not pass on not-applicable checks alone.
    assert!(!crate::verify::Report::all_passed(&checks));
    let report = crate::verify::Report {
        version: crate::verify::report::REPORT_VERSION,
        run_id: "r".into(),
        started_at: String::new(),
        finished_at: String::new(),
        daemon: String::new(),
        seed: 42,
        threat_model: None,
        selected: vec![CheckId::MigSku, CheckId::PartitionArithmetic],
        passed: false,
        checks,
        sweep: vec![],
    };
    let headline = report.headline();
    assert!(
        headline.contains("2 not applicable (NOT CHECKED: 2 mig-sku, 3 partition-arithmetic"),
        "{headline}"
    );
    let table = report.to_table();
    assert!(
        table.lines().nth(1).unwrap().contains("NOT CHECKED"),
        "{table}"
    );
    assert!(table.contains("NOT-APPLICABLE"), "{table}");
    let json = serde_json::to_string(&report).unwrap();
    assert!(json.contains("\"verdict\":\"not-applicable\""), "{json}");
}

/// MPS and time-sliced vGPU share a tenant's GPU without a hardware partition: check 2
/// fails, on a host whose SKUs would otherwise pass.
#[test]
fn check_2_fails_a_host_sharing_tenant_gpus_through_mps_or_time_slicing() {
    let mig = GpuRequest {
        profile: Some("1g.10gb".into()),
        ..Default::default()
    };
    let tenants = vec![tenant_on("a", mig, ("0", vec![0], "1g.10gb@0"))];
    let h100 = [gpu("0", "h100-80gb")];
    assert_eq!(gpu::tenant_gpu_addresses(&tenants, &h100), ["0000:00:00.0"]);
    for broken in [
        Broken::default(),
        Broken {
            gpu_mps: true,
            ..Broken::default()
        },
        Broken {
            gpu_time_sliced: true,
            ..Broken::default()
        },
    ] {
        let healthy = !broken.gpu_mps && !broken.gpu_time_sliced;
        let mut host = FakeVerifyHost::new(broken);
        host.gpus = h100.to_vec();
        for t in &tenants {
            host.add_tenant(t.spec.clone(), t.gpu.clone());
        }
        let r = run_one(&host, &config(), CheckId::MigSku);
        if healthy {
            assert_eq!(r.outcome.verdict, Verdict::Pass, "{r:#?}");
        } else {
            assert_eq!(r.outcome.verdict, Verdict::Fail, "{r:#?}");
            assert!(
                r.outcome
                    .findings
                    .iter()
                    .any(|f| f.contains("without a hardware partition")),
                "{r:#?}"
            );
        }
    }
}

#[test]
fn check_3_a_model_that_does_not_fit_its_slice_fails() {
    let model = |p: &str| GpuRequest {
        model: Some(p.into()),
        context: Some(crate::domain::gpu_request::LEGACY_MODEL_CONTEXT),
        concurrency: Some(crate::domain::gpu_request::LEGACY_MODEL_CONCURRENCY),
        ..Default::default()
    };
    let h100 = [gpu("0", "h100-80gb")];
    // llama-3-8b at 8k context x 4 sequences needs ~21 GiB: a 3g.40gb slice holds it.
    let fits = vec![tenant_on(
        "a",
        model("llama-3-8b"),
        ("0", vec![4, 5, 6, 7], "3g.40gb@4"),
    )];
    let ok = gpu::judge_partitions(&fits, &h100);
    assert_eq!(ok.verdict, Verdict::Pass, "{ok:#?}");
    assert!(ok.value("smallest_headroom_bytes").unwrap() > 0.0);
    // A 1g.10gb slice does not.
    let small = vec![tenant_on(
        "a",
        model("llama-3-8b"),
        ("0", vec![0], "1g.10gb@0"),
    )];
    let bad = gpu::judge_partitions(&small, &h100);
    assert_eq!(bad.verdict, Verdict::Fail, "{bad:#?}");
    assert!(bad.findings.iter().any(|f| f.contains("needs")), "{bad:#?}");
    // Two 70B tenants cannot both live on one H100 at once: the planner says so.
    let two = vec![
        tenant_on(
            "a",
            model("llama-3-70b"),
            ("0", vec![0, 1, 2, 3, 4, 5, 6, 7], "whole"),
        ),
        tenant_on(
            "b",
            model("llama-3-70b"),
            ("0", vec![0, 1, 2, 3, 4, 5, 6, 7], "whole"),
        ),
    ];
    let host = gpu::judge_partitions(&two, &h100);
    assert_eq!(host.verdict, Verdict::Fail, "{host:#?}");
    assert!(
        host.findings.iter().any(|f| f.contains("overlapping")),
        "{host:#?}"
    );
}

#[test]
fn check_4_a_tenant_without_a_memory_limit_fails() {
    assert_pass_then_fail(
        CheckId::MemoryPartition,
        Broken {
            no_memory_limit: true,
            ..Broken::default()
        },
    );
    // A limit that is written but not enforced: the overrun finishes.
    let (v, r) = verdict(
        Broken {
            memory_not_enforced: true,
            ..Broken::default()
        },
        CheckId::MemoryPartition,
    );
    assert_eq!(v, Verdict::Fail, "{r:#?}");
    assert!(
        r.outcome
            .findings
            .iter()
            .any(|f| f.contains("not enforced")),
        "{r:#?}"
    );
    // A limit far above the guest's memory fails too.
    let mut o = Outcome::new(Verdict::Pass);
    memory::judge_memory_limit(&mut o, "t", 128, Some(4 << 30), 512);
    assert_eq!(o.verdict, Verdict::Fail);
    let mut o = Outcome::new(Verdict::Pass);
    memory::judge_memory_limit(&mut o, "t", 128, None, 512);
    assert_eq!(o.verdict, Verdict::Fail);
}

#[test]
fn check_5_a_prefix_cache_shared_by_two_tenants_fails() {
    let (v, r) = verdict(Broken::default(), CheckId::PrefixCache);
    assert_eq!(v, Verdict::Pass, "{r:#?}");
    assert!(r.outcome.value("control.p_value").unwrap() < 1e-3);
    let (v, r) = verdict(
        Broken {
            shared_payload: true,
            ..Broken::default()
        },
        CheckId::PrefixCache,
    );
    assert_eq!(v, Verdict::Fail, "{r:#?}");
    assert!(r.outcome.value("test.median_diff_ms").unwrap() > 20.0);
}

#[test]
fn check_6_two_tenants_routed_to_one_payload_fail() {
    assert_pass_then_fail(
        CheckId::Batching,
        Broken {
            shared_payload: true,
            ..Broken::default()
        },
    );
}

/// Every tenant routed to one engine (one shared prefix cache).
fn shared_engine() -> Broken {
    Broken {
        shared_payload: true,
        ..Broken::default()
    }
}

fn on_engine(engine: FakeEngine, broken: Broken, id: CheckId) -> CheckResult {
    let host = FakeVerifyHost::with_engine(broken, engine);
    run_one(&host, &config(), id)
}

#[test]
fn check_6_llama_engines_are_told_apart_by_effect_and_one_engine_for_two_fails() {
    let r = on_engine(FakeEngine::Llama, Broken::default(), CheckId::Batching);
    assert_eq!(r.outcome.verdict, Verdict::Pass, "{r:#?}");
    // The control saw the repeat cached; the other probe's engine saw nothing of it.
    assert_eq!(
        r.outcome.value("effect.prompt_tokens"),
        Some(32.0),
        "{r:#?}"
    );
    assert_eq!(r.outcome.value("effect.control_cached_tokens"), Some(28.0));
    assert_eq!(r.outcome.value("effect.cross_cached_tokens"), Some(0.0));
    assert_eq!(r.outcome.value("effect.front_door"), Some(1.0));
    assert_eq!(r.outcome.value("engines_read"), Some(2.0));
    assert!(
        r.outcome
            .evidence
            .iter()
            .any(|m| m.name.ends_with(".slots") && m.value == 2.0),
        "{r:#?}"
    );
    // The failing control: two tenants routed to one engine, which has no instance id
    // to give it away: only the effect shows it.
    let r = on_engine(FakeEngine::Llama, shared_engine(), CheckId::Batching);
    assert_eq!(r.outcome.verdict, Verdict::Fail, "{r:#?}");
    assert!(
        r.outcome.findings[0].contains("one engine answers for"),
        "{r:#?}"
    );
    assert_eq!(r.outcome.value("effect.cross_cached_tokens"), Some(28.0));
}

#[test]
fn check_6_an_engine_it_cannot_read_or_tell_apart_is_inconclusive_never_pass() {
    let r = on_engine(FakeEngine::Unreadable, Broken::default(), CheckId::Batching);
    assert_eq!(r.outcome.verdict, Verdict::Inconclusive, "{r:#?}");
    assert!(
        r.outcome
            .findings
            .iter()
            .any(|f| f.contains("could not be read")),
        "{r:#?}"
    );
    // Readable, but its answers count no cached tokens: the effect cannot tell engines
    // apart, and llama-server has no instance id to fall back on.
    let r = on_engine(
        FakeEngine::LlamaUncounted,
        Broken::default(),
        CheckId::Batching,
    );
    assert_eq!(r.outcome.verdict, Verdict::Inconclusive, "{r:#?}");
    assert!(
        r.outcome
            .findings
            .iter()
            .any(|f| f.contains("control did not see")),
        "{r:#?}"
    );
}

#[test]
fn check_6_a_tenant_without_an_engine_is_listed_and_an_unreadable_real_one_is_inconclusive() {
    // A test-guest tenant (no agent) beside the probes: nothing to read, nothing wrong.
    let host = FakeVerifyHost::new(Broken::default());
    host.add_plain_tenant(spec("demo-test-guest", GpuRequest::default()));
    let r = run_one(&host, &config(), CheckId::Batching);
    assert_eq!(r.outcome.verdict, Verdict::Pass, "{r:#?}");
    assert_eq!(r.outcome.value("without_engine"), Some(1.0), "{r:#?}");
    assert!(
        r.outcome
            .findings
            .iter()
            .any(|f| f.starts_with("demo-test-guest: no inference engine")),
        "{r:#?}"
    );
    // A real tenant with an agent whose engine cannot be read: not judged, so not a pass.
    let probe = |n: &str| {
        (
            n.to_string(),
            Ok(Engine::LlamaServer(serde_json::json!({"total_slots": 1}))),
        )
    };
    let reads = vec![
        probe("a"),
        probe("b"),
        (
            "real".to_string(),
            Err("its engine answered 404 to GET /props".to_string()),
        ),
    ];
    let effect = batching::Effect {
        prompt_tokens: 100,
        control_cached: Some(99),
        cross_cached: Some(1),
        front_door: true,
    };
    let o = batching::judge(&reads, Ok(effect), ("a", "b"));
    assert_eq!(o.verdict, Verdict::Inconclusive, "{o:#?}");
    assert!(
        o.findings[0].starts_with("real: its engine could not be read"),
        "{o:#?}"
    );
    let o = batching::judge(&reads[..2].to_vec(), Ok(effect), ("a", "b"));
    assert_eq!(o.verdict, Verdict::Pass, "{o:#?}");
    // Between none and most cached: neither shown apart nor shared.
    let o = batching::judge(
        &reads[..2].to_vec(),
        Ok(batching::Effect {
            cross_cached: Some(30),
            ..effect
        }),
        ("a", "b"),
    );
    assert_eq!(o.verdict, Verdict::Inconclusive, "{o:#?}");
}

#[test]
fn check_5_times_through_the_front_door_on_a_real_engine_and_a_shared_one_fails() {
    let r = on_engine(FakeEngine::Llama, Broken::default(), CheckId::PrefixCache);
    assert_eq!(r.outcome.verdict, Verdict::Pass, "{r:#?}");
    assert_eq!(r.outcome.value("timed_through_front_door"), Some(1.0));
    assert!(
        r.outcome
            .findings
            .iter()
            .any(|f| f.contains("llama-server")),
        "{r:#?}"
    );
    let r = on_engine(FakeEngine::Llama, shared_engine(), CheckId::PrefixCache);
    assert_eq!(r.outcome.verdict, Verdict::Fail, "{r:#?}");
}

#[test]
fn probes_given_a_model_get_it_pushed_and_their_engine_restarted_before_use() {
    let host = FakeVerifyHost::with_engine(Broken::default(), FakeEngine::Llama);
    let cfg = config();
    let probes = Probes::new(
        &host,
        "0badc0de",
        cfg.probe_image.clone(),
        cfg.probe_memory_mib,
        None,
        Duration::from_secs(5),
    )
    .with_model(Some(probe::ProbeModel {
        name: probe::PROBE_MODEL_NAME.into(),
        bytes: std::sync::Arc::new(b"GGUF tiny".to_vec()),
    }));
    let p = probes.create("a", |_| {}).unwrap();
    assert_eq!(host.restarts(), vec![p.name.clone()]);
    assert_eq!(
        host.models_with(&p.name, &p.token).unwrap(),
        vec![probe::PROBE_MODEL_NAME.to_string()]
    );
    drop(p);
    assert!(probes.release_all().is_empty());
}

#[test]
fn check_7_is_inconclusive_when_no_probe_sees_even_its_own_metrics() {
    let (v, r) = verdict(
        Broken {
            metrics_empty: true,
            ..Broken::default()
        },
        CheckId::Visibility,
    );
    assert_eq!(v, Verdict::Inconclusive, "{r:#?}");
    assert_eq!(r.outcome.value("own_metrics_answered"), Some(0.0), "{r:#?}");
}

#[test]
fn check_7_a_debug_mode_that_logs_prompts_fails_and_so_do_cross_reads() {
    assert_pass_then_fail(
        CheckId::Visibility,
        Broken {
            logs_prompts: true,
            ..Broken::default()
        },
    );
    let (v, r) = verdict(
        Broken {
            cross_reads: true,
            ..Broken::default()
        },
        CheckId::Visibility,
    );
    assert_eq!(v, Verdict::Fail, "{r:#?}");
}

#[test]
fn check_7_metrics_served_unscoped_fail_and_the_marker_goes_through_the_front_door() {
    let (v, r) = verdict(Broken::default(), CheckId::Visibility);
    assert_eq!(v, Verdict::Pass, "{r:#?}");
    // Each probe saw its own series twice (API with its token, front door with its key).
    assert_eq!(r.outcome.value("own_metrics_answered"), Some(4.0), "{r:#?}");
    assert_eq!(
        r.outcome.value("marker_via_front_door"),
        Some(1.0),
        "{r:#?}"
    );
    assert_eq!(r.outcome.value("places_with_marker"), Some(0.0), "{r:#?}");
    let (v, r) = verdict(
        Broken {
            metrics_unscoped: true,
            ..Broken::default()
        },
        CheckId::Visibility,
    );
    assert_eq!(v, Verdict::Fail, "{r:#?}");
    for place in ["metrics (API)", "front-door /metrics"] {
        assert!(
            r.outcome.findings.iter().any(|f| f.contains(place)),
            "{place}: {r:#?}"
        );
    }
    // The prompt-logging debug mode is caught on the marker sent through the front door.
    let (v, r) = verdict(
        Broken {
            logs_prompts: true,
            ..Broken::default()
        },
        CheckId::Visibility,
    );
    assert_eq!(v, Verdict::Fail, "{r:#?}");
    assert_eq!(
        r.outcome.value("marker_via_front_door"),
        Some(1.0),
        "{r:#?}"
    );
    assert!(
        r.outcome.findings.iter().any(|f| f.contains("daemon.log")),
        "{r:#?}"
    );
}

#[test]
fn check_4_a_guest_that_takes_more_than_its_ram_fails_and_an_old_agent_is_inconclusive() {
    let (v, r) = verdict(Broken::default(), CheckId::MemoryPartition);
    assert_eq!(v, Verdict::Pass, "{r:#?}");
    // The probe's 128 MiB guest was asked for 192 MiB and stopped below its RAM.
    assert_eq!(
        r.outcome.value("guest_overrun_asked_mib"),
        Some(192.0),
        "{r:#?}"
    );
    assert!(r.outcome.value("guest_overrun_reached_mib").unwrap() < 128.0);
    assert_eq!(r.outcome.value("guest_oom_kills"), Some(1.0));
    assert!(r.outcome.value("neighbour_p50_ratio").unwrap() <= 3.0);
    let (v, r) = verdict(
        Broken {
            guest_ram_unbounded: true,
            ..Broken::default()
        },
        CheckId::MemoryPartition,
    );
    assert_eq!(v, Verdict::Fail, "{r:#?}");
    assert!(
        r.outcome
            .findings
            .iter()
            .any(|f| f.contains("more memory than it was given")),
        "{r:#?}"
    );
    // Its neighbour slowed tenfold meanwhile: that alone fails too.
    assert!(
        r.outcome.value("neighbour_p50_ratio").unwrap() > 3.0,
        "{r:#?}"
    );
    let (v, r) = verdict(
        Broken {
            guest_loads_refused: true,
            ..Broken::default()
        },
        CheckId::MemoryPartition,
    );
    assert_eq!(v, Verdict::Inconclusive, "{r:#?}");
    // A VMM its own cgroup kills when its guest uses all its RAM: stopped, said, not failed.
    let (v, r) = verdict(
        Broken {
            vmm_killed_by_overrun: true,
            ..Broken::default()
        },
        CheckId::MemoryPartition,
    );
    assert_eq!(v, Verdict::Pass, "{r:#?}");
    assert_eq!(
        r.outcome.value("guest_overrun_vm_stopped"),
        Some(1.0),
        "{r:#?}"
    );
    assert!(
        r.outcome
            .findings
            .iter()
            .any(|f| f.contains("its own cgroup stopped its VMM")),
        "{r:#?}"
    );
    // The neighbour judgement alone.
    let mut o = Outcome::new(Verdict::Pass);
    guest_load::judge_neighbour(&mut o, "b", &[10.0; 5], &[40.0; 5], 3.0);
    assert_eq!(o.verdict, Verdict::Fail);
    let mut o = Outcome::new(Verdict::Pass);
    guest_load::judge_neighbour(&mut o, "b", &[10.0; 5], &[], 3.0);
    assert_eq!(o.verdict, Verdict::Inconclusive);
}

#[test]
fn check_8_the_noisy_guest_runs_its_own_cpu_and_disk_load_or_the_check_is_inconclusive() {
    let (v, r) = verdict(Broken::default(), CheckId::NoisyNeighbour);
    assert_eq!(v, Verdict::Pass, "{r:#?}");
    assert!(
        r.outcome.value("noisy_guest_disk_mib_written").unwrap() > 0.0,
        "{r:#?}"
    );
    assert!(r.outcome.value("noisy_guest_cpu_mrounds_per_s").unwrap() > 0.0);
    assert_eq!(r.outcome.value("noisy_guest_cpu_threads"), Some(2.0));
    let (v, r) = verdict(
        Broken {
            guest_loads_refused: true,
            ..Broken::default()
        },
        CheckId::NoisyNeighbour,
    );
    assert_eq!(v, Verdict::Inconclusive, "{r:#?}");
    // Without a CPU quota the in-guest load slows the victim: fail, whatever else.
    let (v, r) = verdict(
        Broken {
            no_cpu_quota: true,
            guest_loads_refused: false,
            ..Broken::default()
        },
        CheckId::NoisyNeighbour,
    );
    assert_eq!(v, Verdict::Fail, "{r:#?}");
}

#[test]
fn check_9_a_disk_that_opens_with_another_tenants_key_fails() {
    let (v, r) = verdict(Broken::default(), CheckId::WeightsAtRest);
    assert_eq!(v, Verdict::Pass, "{r:#?}");
    assert_eq!(r.outcome.value("disks_opened_by_own_key"), Some(2.0));
    assert_eq!(r.outcome.value("disks_opened_by_other_key"), Some(0.0));
    assert_pass_then_fail(
        CheckId::WeightsAtRest,
        Broken {
            shared_disk_key: true,
            ..Broken::default()
        },
    );
    // The control: keys that open nothing prove nothing.
    let (v, r) = verdict(
        Broken {
            keys_open_nothing: true,
            ..Broken::default()
        },
        CheckId::WeightsAtRest,
    );
    assert_eq!(v, Verdict::Inconclusive, "{r:#?}");
}

#[test]
fn check_8_a_tenant_without_a_cpu_quota_fails() {
    let (v, r) = verdict(Broken::default(), CheckId::NoisyNeighbour);
    assert_eq!(v, Verdict::Pass, "{r:#?}");
    assert!(r.outcome.value("p99_ratio").is_some());
    let (v, r) = verdict(
        Broken {
            no_cpu_quota: true,
            ..Broken::default()
        },
        CheckId::NoisyNeighbour,
    );
    assert_eq!(v, Verdict::Fail, "{r:#?}");
    // A quota written but not enforced: busy processes in the cgroup take more.
    let (v, r) = verdict(
        Broken {
            cpu_not_enforced: true,
            ..Broken::default()
        },
        CheckId::NoisyNeighbour,
    );
    assert_eq!(v, Verdict::Fail, "{r:#?}");
    assert!(
        r.outcome
            .findings
            .iter()
            .any(|f| f.contains("not enforced")),
        "{r:#?}"
    );
    // A host too busy to give more than the quota even outside: the control failed, so
    // the quota was not shown to bind: never a pass.
    let mut o = Outcome::new(Verdict::Pass);
    let busy = super::host::CpuOverrun {
        workers: 2,
        outside_cpus: 1.0,
        inside_cpus: 1.0,
    };
    noisy::judge_cpu_enforcement(&mut o, "t", 1.0, &busy);
    assert_eq!(o.verdict, Verdict::Inconclusive);
    assert!(o.findings[0].contains("could not be shown"), "{o:?}");
    // The control could not run at all: never a pass either.
    let (v, r) = verdict(
        Broken {
            cpu_control_fails: true,
            ..Broken::default()
        },
        CheckId::NoisyNeighbour,
    );
    assert_eq!(v, Verdict::Inconclusive, "{r:#?}");
    assert!(
        r.outcome
            .findings
            .iter()
            .any(|f| f.contains("its control did not run")),
        "{r:#?}"
    );
    // The latency judgement alone fails a 10x slower neighbour.
    let mut o = Outcome::new(Verdict::Pass);
    noisy::judge_latency(&mut o, &[2.0; 10], &[20.0; 10], 3.0);
    assert_eq!(o.verdict, Verdict::Fail);
    assert_eq!(o.value("p99_ratio"), Some(10.0));
}

#[test]
fn check_9_a_plaintext_disk_fails() {
    assert_pass_then_fail(
        CheckId::WeightsAtRest,
        Broken {
            plaintext_disk: true,
            ..Broken::default()
        },
    );
    let (_, r) = verdict(Broken::default(), CheckId::WeightsAtRest);
    assert_eq!(r.outcome.value("marker_models_pushed"), Some(2.0), "{r:#?}");
    assert_eq!(
        r.outcome.value("control_found_plaintext_copy"),
        Some(1.0),
        "{r:#?}"
    );
}

#[test]
fn check_9_a_blind_scan_is_inconclusive_never_a_pass() {
    // The plaintext disk is there, but the scan cannot see: the control says so.
    let (v, r) = verdict(
        Broken {
            plaintext_disk: true,
            blind_scan: true,
            ..Broken::default()
        },
        CheckId::WeightsAtRest,
    );
    assert_eq!(v, Verdict::Inconclusive, "{r:#?}");
    assert_eq!(
        r.outcome.value("control_found_plaintext_copy"),
        Some(0.0),
        "{r:#?}"
    );
}

#[test]
fn a_marker_model_holds_its_marker_many_times() {
    let model = super::checks::at_rest::marker_model("tvm-verify-rest-marker-0123");
    assert!(model.len() >= 64 << 10);
    let text = String::from_utf8(model).unwrap();
    assert!(text.matches("tvm-verify-rest-marker-0123").count() > 1000);
}

#[test]
fn check_10_a_departure_with_the_shred_step_disabled_fails() {
    let (v, r) = verdict(Broken::default(), CheckId::Departure);
    assert_eq!(v, Verdict::Pass, "{r:#?}");
    assert_eq!(r.outcome.value("receipt_steps_simulated"), Some(1.0));
    let (v, r) = verdict(
        Broken {
            shred_disabled: true,
            ..Broken::default()
        },
        CheckId::Departure,
    );
    assert_eq!(v, Verdict::Fail, "{r:#?}");
    assert!(
        r.outcome.findings.iter().any(|f| f.contains("CryptoShred")),
        "{r:#?}"
    );
}

#[test]
fn check_10_pushes_a_model_and_fails_a_receipt_silent_on_it() {
    let (v, r) = verdict(Broken::default(), CheckId::Departure);
    assert_eq!(v, Verdict::Pass, "{r:#?}");
    assert_eq!(r.outcome.value("model_pushed"), Some(1.0));
    let (v, r) = verdict(
        Broken {
            receipt_silent_on_models: true,
            ..Broken::default()
        },
        CheckId::Departure,
    );
    assert_eq!(v, Verdict::Fail, "{r:#?}");
    assert!(
        r.outcome
            .findings
            .iter()
            .any(|f| f.contains("does not say the disk held it")),
        "{r:#?}"
    );
}

#[test]
fn checks_needing_probes_are_inconclusive_without_a_probe_image() {
    let host = FakeVerifyHost::new(Broken::default());
    let cfg = VerifyConfig::default();
    let r = run_one(&host, &cfg, CheckId::MemoryPartition);
    assert_eq!(r.outcome.verdict, Verdict::Inconclusive, "{r:#?}");
    assert!(r.outcome.findings[0].contains("--probe-image"));
}

#[test]
fn selection_parses_numbers_and_names_in_checklist_order() {
    assert_eq!(
        parse_selection("10, prefix-cache,1,5").unwrap(),
        vec![
            CheckId::ThreatModel,
            CheckId::PrefixCache,
            CheckId::Departure
        ]
    );
    parse_selection("11").unwrap_err();
    parse_selection("nope").unwrap_err();
    parse_selection("").unwrap_err();
    for (i, id) in CheckId::ALL.iter().enumerate() {
        assert_eq!(id.number() as usize, i + 1);
        assert_eq!(id.key().parse::<CheckId>().unwrap(), *id);
    }
}

#[test]
fn probe_names_follow_the_tenant_name_rule_and_are_recognised() {
    let n = probe_name("0badc0de", "mem0").unwrap();
    TenantName::check(n.as_str()).unwrap();
    assert!(looks_like_probe(n.as_str()));
    assert!(!looks_like_probe("alice"));
    assert!(!looks_like_probe("tvm-verify-xyz-a"));
    probe_name("0badc0de", &"x".repeat(60)).unwrap_err();
}

#[test]
fn probes_are_destroyed_even_when_a_check_panics_and_the_ledger_sweeps_leftovers() {
    let host = FakeVerifyHost::new(Broken::default());
    let dir = tempfile::tempdir().unwrap();
    let ledger = dir.path().join("probes");
    // A run that dies after creating a probe (the guard is leaked, as a kill would).
    {
        let probes = Probes::new(
            &host,
            "11111111",
            Some("ngram".into()),
            128,
            Some(ledger.clone()),
            Duration::from_secs(1),
        );
        let p = probes.create("a", |_| {}).unwrap();
        std::mem::forget(p);
        std::mem::forget(probes);
    }
    // A real tenant that merely looks like a probe, and one that does not.
    host.add_tenant(spec("tvm-verify-22222222-a0", GpuRequest::default()), None);
    host.add_tenant(spec("alice", GpuRequest::default()), None);
    assert_eq!(host.names().len(), 3);
    let probes = Probes::new(
        &host,
        "33333333",
        Some("ngram".into()),
        128,
        Some(ledger.clone()),
        Duration::from_secs(1),
    );
    let lines = probes.sweep().unwrap();
    assert_eq!(
        host.names(),
        vec!["alice", "tvm-verify-22222222-a0"],
        "{lines:?}"
    );
    assert!(lines
        .iter()
        .any(|l| l.contains("in the probe ledger; destroyed")));
    assert!(lines
        .iter()
        .any(|l| l.contains("not in the ledger; left alone")));
    assert_eq!(std::fs::read_to_string(&ledger).unwrap(), "");
    // A guard dropped during a panic still destroys its probe.
    let result = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        let _p = probes.create("b", |_| {}).unwrap();
        panic!("a check blew up");
    }));
    assert!(result.is_err());
    assert_eq!(host.names(), vec!["alice", "tvm-verify-22222222-a0"]);
    assert!(probes.release_all().is_empty());
}

#[test]
fn a_probe_name_already_taken_is_refused_and_the_real_tenant_kept() {
    let host = FakeVerifyHost::new(Broken::default());
    host.add_tenant(spec("tvm-verify-44444444-a0", GpuRequest::default()), None);
    let probes = Probes::new(
        &host,
        "44444444",
        Some("ngram".into()),
        128,
        None,
        Duration::from_secs(1),
    );
    let err = probes.create("a", |_| {}).err().unwrap();
    assert_eq!(err.status(), Some(409));
    // The failed create's cleanup must not have destroyed the real tenant... which the
    // daemon would refuse anyway for a name we did not create; the fake destroys by name,
    // so the framework must not call destroy for a refused create.
    assert_eq!(host.names(), vec!["tvm-verify-44444444-a0"]);
}

#[test]
fn the_report_prints_a_table_and_is_appended_signed_to_the_audit_log() {
    let host = FakeVerifyHost::new(Broken::default());
    let cfg = config();
    let probes = Probes::new(
        &host,
        "55555555",
        cfg.probe_image.clone(),
        128,
        None,
        Duration::from_secs(1),
    );
    let checks = run_checks(
        &host,
        &probes,
        &cfg,
        1,
        &[CheckId::ThreatModel, CheckId::Batching],
    );
    let report = Report {
        version: report::REPORT_VERSION,
        run_id: "55555555".into(),
        started_at: "2026-01-01T00:00:00Z".into(),
        finished_at: "2026-01-01T00:00:01Z".into(),
        daemon: "fake".into(),
        seed: 1,
        threat_model: None,
        selected: vec![CheckId::ThreatModel, CheckId::Batching],
        passed: Report::all_passed(&checks),
        checks,
        sweep: Vec::new(),
    };
    assert!(!report.passed, "no threat model: not passed");
    let table = report.to_table();
    assert!(
        table.contains("threat-model") && table.contains("FAIL"),
        "{table}"
    );
    assert!(
        table.contains("batching") && table.contains("PASS"),
        "{table}"
    );
    assert!(
        table.contains("NOT PASSED: 1 pass, 1 fail, 0 inconclusive"),
        "{table}"
    );
    let json = serde_json::to_string(&report).unwrap();
    let back: Report = serde_json::from_str(&json).unwrap();
    assert_eq!(back, report);

    let dir = tempfile::tempdir().unwrap();
    let log = dir.path().join("audit/receipts.jsonl");
    let key = dir.path().join("audit/receipt-signing.key");
    // No signing key: refused, nothing created.
    assert!(matches!(
        audit::record(&report, &log, &key),
        Err(audit::AuditError::NoSigningKey(_))
    ));
    assert!(!key.exists());
    std::fs::create_dir_all(key.parent().unwrap()).unwrap();
    let signer = crate::receipt::ReceiptSigner::load_or_create(&key).unwrap();
    let entry = audit::record(&report, &log, &key).unwrap();
    let v = entry.receipt.verification.as_ref().unwrap();
    assert!(!v.passed);
    assert_eq!(v.checks["threat-model"], "fail");
    let saved = std::fs::read(audit::report_path(&log, "55555555")).unwrap();
    use sha2::Digest;
    assert_eq!(v.report_sha256, hex::encode(sha2::Sha256::digest(&saved)));
    let verified = crate::receipt::AuditLog::new(&log)
        .verify(&signer.verifying_key())
        .unwrap();
    assert!(verified.is_intact(), "{verified:?}");
    let mut shown = Vec::new();
    crate::receipt::write_entries(&[entry], &mut shown).unwrap();
    let shown = String::from_utf8(shown).unwrap();
    assert!(
        shown.contains("verification 55555555: NOT passed"),
        "{shown}"
    );
}

#[test]
fn check_10_a_host_side_step_left_unverified_fails_but_a_guest_reported_one_does_not() {
    use crate::receipt::{Assurance, DepartureStep, LogEntry, Receipt, StepRecord, StepResult};
    let entry = |shred: Assurance, shutdown: Assurance| {
        let step =
            |s, a| StepRecord::new(s, "test", StepResult::Ok, a, String::new(), String::new());
        vec![LogEntry {
            seq: 0,
            prev_hash: String::new(),
            appended_at: String::new(),
            key_id: String::new(),
            receipt: Receipt {
                version: 1,
                departure_id: "d".into(),
                tenant: "t".into(),
                started_at: String::new(),
                finished_at: String::new(),
                steps: vec![
                    step(DepartureStep::AgentShutdown, shutdown),
                    step(DepartureStep::CryptoShred, shred),
                    step(DepartureStep::LogsRemoved, Assurance::Verified),
                ],
                verification: None,
            },
            signature: String::new(),
        }]
    };
    let ok = departure::judge_departure(
        "t",
        false,
        &[],
        &entry(Assurance::Verified, Assurance::Unverified),
    );
    assert_eq!(ok.verdict, Verdict::Pass, "{ok:#?}");
    assert_eq!(ok.value("receipt_guest_reported_steps"), Some(1.0));
    let bad = departure::judge_departure(
        "t",
        false,
        &[],
        &entry(Assurance::Unverified, Assurance::Verified),
    );
    assert_eq!(bad.verdict, Verdict::Fail, "{bad:#?}");
    let left = departure::judge_departure(
        "t",
        false,
        &["its cgroup".into()],
        &entry(Assurance::Verified, Assurance::Verified),
    );
    assert_eq!(left.verdict, Verdict::Fail);
    let none = departure::judge_departure("t", false, &[], &[]);
    assert_eq!(none.verdict, Verdict::Fail);
}

#[test]
fn an_interrupted_run_refuses_new_probes_and_its_sweep_keeps_names_not_yet_created() {
    let host = FakeVerifyHost::new(Broken::default());
    let dir = tempfile::tempdir().unwrap();
    let ledger = dir.path().join("probes");
    let cancel = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let probes = Probes::new(
        &host,
        "66666666",
        Some("ngram".into()),
        128,
        Some(ledger.clone()),
        Duration::from_secs(1),
    )
    .with_cancel(cancel.clone());
    std::mem::forget(probes.create("a", |_| {}).unwrap());
    // A create on its way when Ctrl-C came: in the ledger, not yet a tenant.
    std::fs::write(
        &ledger,
        format!(
            "{}\ntvm-verify-66666666-b9\n",
            std::fs::read_to_string(&ledger).unwrap().trim()
        ),
    )
    .unwrap();
    cancel.store(true, std::sync::atomic::Ordering::Relaxed);
    assert!(probes.create("c", |_| {}).is_err());
    let cleanup = Probes::new(
        &host,
        "interrupt",
        None,
        0,
        Some(ledger.clone()),
        Duration::from_secs(1),
    );
    let lines = cleanup.sweep_interrupted().unwrap();
    assert!(host.names().is_empty(), "{lines:?}");
    assert_eq!(
        std::fs::read_to_string(&ledger).unwrap(),
        "tvm-verify-66666666-b9\n"
    );
    // The next run's sweep forgets it once it is sure it does not exist.
    cleanup.sweep().unwrap();
    assert_eq!(std::fs::read_to_string(&ledger).unwrap(), "");
}
