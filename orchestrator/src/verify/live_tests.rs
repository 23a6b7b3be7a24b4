//! [`LiveHost`] against a daemon: the real API router served on a Unix socket over the
//! service's fake host (tenant/test_utils.rs), a real state directory with LUKS2 disks,
//! wrapped keys and the signed audit log, and a fake cgroup v2 tree. What is live here is
//! the verifier's whole path: API calls and waits, tenant-token reads, probe ledger and
//! sweep, cgroup and file reads, the departure check end to end.

use std::path::{Path, PathBuf};
use std::time::Duration;

use super::checks::*;
use super::live::{LiveHost, LivePaths};
use super::probe::Probes;
use super::*;
use crate::api::types::LogStream;
use crate::tenant::fault::FaultHook;
use crate::tenant::test_utils::Harness;

struct Daemon {
    h: Harness,
    rt: tokio::runtime::Runtime,
    admin: String,
    socket: PathBuf,
    cgroups: tempfile::TempDir,
}

impl Daemon {
    fn start(fault: FaultHook) -> Daemon {
        Self::start_with(Harness::new(fault))
    }

    /// A daemon over a SIMULATED host of one empty H100 with MIG on (the planner writes its
    /// MIG changes to the file the verifier reads), with `fault` armed; also the backend
    /// argument for the verifier.
    fn start_sim_gpu(fault: FaultHook) -> (Daemon, String) {
        Self::start_sim(
            fault,
            r#"{"gpus":[{"index":0,"model":"h100-80gb","pci_address":"0000:18:00.0","mig_enabled":true,"iommu_group":30}]}"#,
        )
    }

    /// A daemon over the SIMULATED host described by `host_json`.
    fn start_sim(fault: FaultHook, host_json: &str) -> (Daemon, String) {
        let h = Harness::new(FaultHook::default());
        let path = h.dir.path().join("sim-host.json");
        std::fs::write(&path, host_json).unwrap();
        let backend =
            tenantvm_gpu::backend::open(&tenantvm_gpu::backend::BackendSpec::Sim(path.clone()))
                .unwrap();
        let mut h = h.with_planner(std::sync::Arc::new(crate::gpu::BackendPlanner::new(
            backend,
        )));
        h.restart(fault);
        (Self::start_with(h), format!("sim:{}", path.display()))
    }

    fn start_with(h: Harness) -> Daemon {
        let admin = h.admin_token();
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .enable_all()
            .build()
            .unwrap();
        let socket = h.dir.path().join("api.sock");
        let app = crate::api::router(h.svc.clone());
        let listener = rt.block_on(async { tokio::net::UnixListener::bind(&socket).unwrap() });
        rt.spawn(async move { axum::serve(listener, app).await });
        let cgroups = tempfile::tempdir().unwrap();
        std::fs::write(
            cgroups.path().join("cgroup.controllers"),
            "cpu memory pids\n",
        )
        .unwrap();
        Daemon {
            h,
            rt,
            admin,
            socket,
            cgroups,
        }
    }

    fn state_dir(&self) -> PathBuf {
        self.h.dir.path().join("state")
    }

    fn host(&self) -> LiveHost {
        self.host_with_gpus(None)
    }

    /// The live host reading the GPUs of `backend` (`sim:FILE`) and the harness's store.
    fn host_with_gpus(&self, backend: Option<String>) -> LiveHost {
        LiveHost::new(
            &self.admin,
            self.rt.handle().clone(),
            LivePaths {
                socket: self.socket.clone(),
                state_dir: self.state_dir(),
                cgroup_root: self.cgroups.path().to_path_buf(),
                gpu_backend: backend,
                gpu_sysfs_root: std::path::PathBuf::from("/nonexistent/sysfs"),
                scan_extra: Vec::new(),
                kek_file: std::path::PathBuf::from("/nonexistent/tenantvm-kek"),
            },
        )
        .with_store_db(self.h.dir.path().join("state.db"))
    }

    /// Writes a v2 cgroup for `tenant` in the daemon's subtree, as the jail would.
    fn write_cgroup(&self, tenant: &str, memory_max: &str, cpu_max: &str) {
        let sub = crate::jail::cgroup::daemon_subtree(&self.state_dir()).unwrap();
        let dir = self.cgroups.path().join(sub).join(tenant);
        std::fs::create_dir_all(&dir).unwrap();
        std::fs::write(dir.join("memory.max"), memory_max).unwrap();
        std::fs::write(dir.join("cpu.max"), cpu_max).unwrap();
        std::fs::write(dir.join("pids.max"), "256").unwrap();
    }
}

fn probes<'h>(host: &'h LiveHost, run: &str, ledger: Option<&Path>) -> Probes<'h> {
    probes_waiting(host, run, ledger, Duration::from_secs(20))
}

fn probes_waiting<'h>(
    host: &'h LiveHost,
    run: &str,
    ledger: Option<&Path>,
    wait: Duration,
) -> Probes<'h> {
    Probes::new(
        host,
        run,
        Some("hello".into()),
        64,
        ledger.map(Path::to_path_buf),
        wait,
    )
}

#[test]
fn probes_are_created_through_the_api_and_tenant_tokens_are_held_apart() {
    let d = Daemon::start(FaultHook::default());
    let host = d.host();
    assert!(!host.daemon().unwrap().is_empty());
    let p = probes(&host, "aaaa0001", None);
    let a = p.create("a", |_| {}).unwrap();
    let b = p.create("b", |_| {}).unwrap();
    assert_eq!(
        host.tenant(&a.name).unwrap().unwrap().state,
        crate::domain::lifecycle::LifecycleState::Running
    );
    for stream in [LogStream::Serial, LogStream::Vmm, LogStream::Events] {
        host.logs_with(&a.name, &a.token, stream).unwrap();
        let refused = host.logs_with(&a.name, &b.token, stream).unwrap_err();
        assert!(matches!(refused.status(), Some(403 | 404)), "{refused}");
    }
    let refused = host.receipts_with(&a.name, &b.token).unwrap_err();
    assert!(matches!(refused.status(), Some(403 | 404)), "{refused}");
    assert_eq!(host.receipts_with(&a.name, &a.token).unwrap(), 0);
    // cgroup limits are read from the kernel's files: none yet, then a v2 cgroup without a
    // memory limit, which check 4 fails.
    assert!(host.cgroup_limits(&a.name).unwrap().is_none());
    d.write_cgroup(&a.name, "max", "max 100000");
    let l = host.cgroup_limits(&a.name).unwrap().unwrap();
    assert_eq!((l.memory_bytes, l.cpu_quota_us), (u64::MAX, u64::MAX));
    let mut o = Outcome::new(Verdict::Pass);
    memory::judge_memory_limit(&mut o, &a.name, 64, Some(l.memory_bytes), 512);
    assert_eq!(o.verdict, Verdict::Fail);
    d.write_cgroup(&b.name, &((128u64 << 20).to_string()), "100000 100000");
    let l = host.cgroup_limits(&b.name).unwrap().unwrap();
    assert_eq!((l.memory_bytes, l.cpu_quota_us), (128 << 20, 100_000));
    drop(a);
    drop(b);
    assert!(p.release_all().is_empty());
    assert!(host.tenants().unwrap().is_empty());
}

#[test]
fn the_sweep_destroys_a_killed_runs_probes_through_the_api() {
    let d = Daemon::start(FaultHook::default());
    let host = d.host();
    let ledger = d.h.dir.path().join("verify/probes");
    {
        let p = probes(&host, "aaaa0002", Some(&ledger));
        std::mem::forget(p.create("a", |_| {}).unwrap());
    }
    assert_eq!(host.tenants().unwrap().len(), 1);
    let lines = probes(&host, "aaaa0003", Some(&ledger)).sweep().unwrap();
    assert!(lines[0].contains("destroyed"), "{lines:?}");
    assert!(host.tenants().unwrap().is_empty());
}

#[test]
fn the_departure_check_passes_on_a_daemon_that_shreds_and_fails_when_shred_never_runs() {
    let d = Daemon::start(FaultHook::default());
    let host = d.host();
    let p = probes(&host, "aaaa0004", None);
    let cfg = VerifyConfig {
        probe_image: Some("hello".into()),
        ..VerifyConfig::default()
    };
    let r = run_checks(&host, &p, &cfg, 1, &[CheckId::Departure]).remove(0);
    assert_eq!(r.outcome.verdict, Verdict::Pass, "{r:#?}");
    assert!(r.outcome.value("receipt_steps").unwrap() >= 2.0);

    // The test-only hook stops every departure before its crypto-shred step.
    let d = Daemon::start(FaultHook::fail_at(
        "destroy",
        "crypto-shred",
        crate::tenant::fault::Boundary::Before,
    ));
    let host = d.host();
    // A destroy stopped by the hook is seen as a destroy that does not finish in time.
    let p = probes_waiting(&host, "aaaa0005", None, Duration::from_secs(2));
    let r = run_checks(&host, &p, &cfg, 1, &[CheckId::Departure]).remove(0);
    assert_eq!(r.outcome.verdict, Verdict::Fail, "{r:#?}");
    assert!(
        r.outcome
            .findings
            .iter()
            .any(|f| f.contains("left behind: its wrapped disk key")),
        "{r:#?}"
    );
}

#[test]
fn the_departure_checks_gpu_half_passes_on_the_simulated_gpu_host_and_sees_a_left_instance() {
    let (d, backend) = Daemon::start_sim_gpu(FaultHook::default());
    let host = d.host_with_gpus(Some(backend));
    let p = probes(&host, "aaaa0006", None);
    let cfg = VerifyConfig {
        probe_image: Some("hello".into()),
        ..VerifyConfig::default()
    };
    let r = run_checks(&host, &p, &cfg, 1, &[CheckId::Departure]).remove(0);
    assert_eq!(r.outcome.verdict, Verdict::Pass, "{r:#?}");
    assert_eq!(r.outcome.value("gpu_probe"), Some(1.0), "{r:#?}");
    assert_eq!(
        r.outcome.value("gpu_seen_while_running_reservations"),
        Some(1.0),
        "{r:#?}"
    );
    assert_eq!(
        r.outcome.value("gpu_seen_while_running_instances"),
        Some(1.0),
        "{r:#?}"
    );
    assert_eq!(r.outcome.value("gpu_left_mig_instances"), Some(0.0));

    // The test-only hook stops every departure before its MIG instance is destroyed.
    let (d, backend) = Daemon::start_sim_gpu(FaultHook::fail_at(
        "destroy",
        "destroy-gpu-instance",
        crate::tenant::fault::Boundary::Before,
    ));
    let host = d.host_with_gpus(Some(backend));
    let p = probes_waiting(&host, "aaaa0007", None, Duration::from_secs(2));
    let r = run_checks(&host, &p, &cfg, 1, &[CheckId::Departure]).remove(0);
    assert_eq!(r.outcome.verdict, Verdict::Fail, "{r:#?}");
    assert!(
        r.outcome
            .findings
            .iter()
            .any(|f| f.contains("left behind: MIG instance 0000:18:00.0")),
        "{r:#?}"
    );
    assert!(
        r.outcome
            .findings
            .iter()
            .any(|f| f.contains("left behind: GPU reservation 0000:18:00.0/")),
        "{r:#?}"
    );
}

#[test]
fn a_whole_non_mig_card_is_given_back_and_one_left_reserved_is_seen() {
    let cfg = VerifyConfig {
        probe_image: Some("hello".into()),
        ..VerifyConfig::default()
    };
    let l40s = r#"{"gpus":[{"index":0,"model":"l40s","pci_address":"0000:41:00.0","mig_enabled":false,"iommu_group":22}]}"#;
    let (d, backend) = Daemon::start_sim(FaultHook::default(), l40s);
    let host = d.host_with_gpus(Some(backend));
    let p = probes(&host, "aaaa0008", None);
    let r = run_checks(&host, &p, &cfg, 1, &[CheckId::Departure]).remove(0);
    assert_eq!(r.outcome.verdict, Verdict::Pass, "{r:#?}");
    assert!(
        r.outcome
            .findings
            .iter()
            .any(|f| f.contains("held GPU slice 0000:41:00.0/whole")),
        "{r:#?}"
    );
    // A simulated card has no sysfs device: its binding is not seen, and the report says so.
    assert_eq!(
        r.outcome.value("gpu_seen_while_running_vfio_bound"),
        Some(0.0),
        "{r:#?}"
    );
    assert!(
        r.outcome
            .findings
            .iter()
            .any(|f| f.starts_with("not looked at: GPU 0000:41:00.0")),
        "{r:#?}"
    );

    // The departure stopped before the card is given back to its host driver.
    let (d, backend) = Daemon::start_sim(
        FaultHook::fail_at(
            "destroy",
            "rebind-gpu",
            crate::tenant::fault::Boundary::Before,
        ),
        l40s,
    );
    let host = d.host_with_gpus(Some(backend));
    let p = probes_waiting(&host, "aaaa0009", None, Duration::from_secs(2));
    let r = run_checks(&host, &p, &cfg, 1, &[CheckId::Departure]).remove(0);
    assert_eq!(r.outcome.verdict, Verdict::Fail, "{r:#?}");
    assert!(
        r.outcome
            .findings
            .iter()
            .any(|f| f.contains("left behind: GPU reservation 0000:41:00.0/whole")),
        "{r:#?}"
    );
}

#[test]
fn the_gpus_come_from_the_named_backend_with_the_planners_models() {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let fixtures = Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/fixtures/hosts");
    let host = |backend: Option<String>| {
        LiveHost::new(
            "unused",
            rt.handle().clone(),
            LivePaths {
                socket: PathBuf::from("/nonexistent.sock"),
                state_dir: PathBuf::from("/nonexistent"),
                cgroup_root: PathBuf::from("/nonexistent"),
                gpu_backend: backend,
                gpu_sysfs_root: PathBuf::from("/nonexistent"),
                scan_extra: Vec::new(),
                kek_file: std::path::PathBuf::from("/nonexistent/tenantvm-kek"),
            },
        )
    };
    assert!(host(None).gpus().unwrap().is_empty());
    let mixed = host(Some(format!(
        "sim:{}",
        fixtures.join("sim-mixed.json").display()
    )))
    .gpus()
    .unwrap();
    let keys: Vec<(&str, &str, bool)> = mixed
        .iter()
        .map(|g| (g.index.as_str(), g.model.key, g.model.has_mig()))
        .collect();
    assert_eq!(
        keys,
        vec![
            ("0", "a100-40gb", true),
            ("1", "h200", true),
            ("2", "rtx-pro-6000", true)
        ]
    );
    let whole = host(Some(format!(
        "sim:{}",
        fixtures.join("sim-whole-only.json").display()
    )))
    .gpus()
    .unwrap();
    assert!(whole.iter().any(|g| !g.model.has_mig()), "{whole:?}");
    let err = host(Some("sim:/nonexistent.json".into()))
        .gpus()
        .unwrap_err();
    assert!(err.to_string().contains("GPU backend"), "{err}");
}

#[test]
fn metrics_models_and_inference_keys_are_scoped_and_the_scan_control_finds_a_plaintext_copy() {
    let d = Daemon::start(FaultHook::default());
    let host = d.host();
    let p = probes(&host, "aaaa0005", None);
    let a = p.create("a", |_| {}).unwrap();
    let b = p.create("b", |_| {}).unwrap();
    // Metrics: a tenant's token reads no other tenant's series (this test daemon's VMs have
    // no cgroup to sample, so no probe has a series yet: the text is the families' heads).
    let own = host.metrics_with(Some(&a.token)).unwrap();
    assert!(own.contains("# TYPE tenantvm_"), "{own}");
    assert!(!own.contains(b.name.as_str()), "{own}");
    host.metrics_with(None).unwrap();
    let refused = host.metrics_with(Some("not-a-token")).unwrap_err();
    assert_eq!(refused.status(), Some(401), "{refused}");
    // Models: another tenant's listing is refused.
    let refused = host.models_with(&a.name, &b.token).unwrap_err();
    assert!(matches!(refused.status(), Some(403 | 404)), "{refused}");
    // An inference key is no API credential: every read with it is refused.
    let key = host.inference_key(&b.name, &b.token).unwrap();
    let refused = host
        .logs_with(&a.name, &key, LogStream::Events)
        .unwrap_err();
    assert!(
        matches!(refused.status(), Some(401 | 403 | 404)),
        "{refused}"
    );
    let refused = host.receipts_with(&a.name, &key).unwrap_err();
    assert!(
        matches!(refused.status(), Some(401 | 403 | 404)),
        "{refused}"
    );
    // No front door named: said so, not guessed.
    assert!(matches!(
        host.front_door(&key, "/metrics", None),
        Err(HostError::Unsupported(_))
    ));
    // This test daemon's guests have no vsock of their own: model push is refused (409),
    // which check 9 reports rather than counts.
    let refused = host
        .push_model(&a.name, &a.token, "tvm-verify-marker", b"weights")
        .unwrap_err();
    assert_eq!(refused.status(), Some(409), "{refused}");
    // The scan's positive control finds a plaintext copy in the state dir and removes it.
    let marker = at_rest::new_marker("ctl");
    let model = at_rest::marker_model(&marker);
    assert!(host.scan_finds(&model, marker.as_bytes()).unwrap());
    assert!(!host.scan_finds(b"other bytes", marker.as_bytes()).unwrap());
    let left: Vec<_> = std::fs::read_dir(d.state_dir())
        .unwrap()
        .filter_map(|e| e.ok())
        .filter(|e| {
            e.file_name()
                .to_string_lossy()
                .starts_with("verify-scan-control")
        })
        .collect();
    assert!(left.is_empty(), "{left:?}");
    drop(a);
    drop(b);
    assert!(p.release_all().is_empty());
}

#[test]
fn the_front_door_client_reads_a_probes_own_metrics_with_its_key_and_nothing_without_one() {
    let d = Daemon::start(FaultHook::default());
    let host = d.host();
    let p = probes(&host, "aaaa0006", None);
    let a = p.create("a", |_| {}).unwrap();
    let key = host.inference_key(&a.name, &a.token).unwrap();
    let pair = crate::test_support::tls_pair::TlsPair::write(d.h.dir.path());
    let tls = crate::frontdoor::tls_config(&pair.cert_pem, &pair.key_pem).unwrap();
    let listener =
        d.rt.block_on(crate::frontdoor::bind("127.0.0.1:0".parse().unwrap()))
            .unwrap();
    let addr = listener.local_addr().unwrap();
    d.rt.spawn(crate::frontdoor::serve(
        listener,
        tls,
        d.h.svc.clone(),
        std::future::pending(),
    ));
    let host = d
        .host()
        .with_front_door(super::door::FrontDoorTarget {
            addr,
            server_name: "localhost".into(),
            ca: pair.cert_pem,
        })
        .unwrap();
    let (status, text) = host.front_door(&key, "/metrics", None).unwrap();
    assert_eq!(status, 200, "{text}");
    // The first request is counted after it is answered: the second shows it, by tenant.
    let (status, text) = host.front_door(&key, "/metrics", None).unwrap();
    assert_eq!(status, 200, "{text}");
    assert!(text.contains(a.name.as_str()), "{text}");
    let (status, _) = host.front_door("tvm-not-a-key", "/metrics", None).unwrap();
    assert_eq!(status, 401);
    drop(a);
    assert!(p.release_all().is_empty());
}
