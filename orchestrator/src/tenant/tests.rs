//! Tests of the tenant service and reconciliation over the fake host
//! ([`super::test_utils`]).

use crate::auth::Caller;
use crate::domain::lifecycle::LifecycleState;
use crate::domain::spec::TenantSpec;
use crate::reconcile::{reconcile, ReconcileOptions};
use crate::store::ResourceKind;
use crate::tenant::context::Tenant;
use crate::tenant::fault::{Boundary, FaultHook};
use crate::tenant::service::{CommandOutcome, TenantCommand, TenantServiceError};
use crate::tenant::steps::Op;
use crate::tenant::test_utils::Harness;

fn spec(name: &str, gpu: &str) -> TenantSpec {
    TenantSpec::from_toml(&format!(
        "name = \"{name}\"\ngpu = {gpu}\n[image]\nname = \"hello\"\n"
    ))
    .unwrap()
}

fn create(h: &Harness, name: &str) -> String {
    match h
        .svc
        .execute(
            &Caller::Admin,
            TenantCommand::Create(spec(name, "{ kind = \"none\" }")),
        )
        .unwrap()
    {
        CommandOutcome::Created(c) => c.token,
        other => panic!("{other:?}"),
    }
}

fn state(h: &Harness, name: &str) -> Option<LifecycleState> {
    h.svc.store().tenant(name).unwrap().map(|t| t.state)
}

#[test]
fn create_stop_start_destroy_walks_the_lifecycle() {
    let h = Harness::new(FaultHook::default());
    create(&h, "alice");
    h.svc.wait_idle();
    assert_eq!(state(&h, "alice"), Some(LifecycleState::Running));
    assert_eq!(h.host.state().processes.len(), 1);
    let dir = h.svc.config().tenant_dir("alice");
    assert!(dir.is_dir());

    h.svc
        .execute(&Caller::Admin, TenantCommand::Stop("alice".into()))
        .unwrap();
    h.svc.wait_idle();
    assert_eq!(state(&h, "alice"), Some(LifecycleState::Stopped));
    assert!(h.host.state().processes.is_empty());

    h.svc
        .execute(&Caller::Admin, TenantCommand::Start("alice".into()))
        .unwrap();
    h.svc.wait_idle();
    assert_eq!(state(&h, "alice"), Some(LifecycleState::Running));

    h.svc
        .execute(&Caller::Admin, TenantCommand::Destroy("alice".into()))
        .unwrap();
    h.svc.wait_idle();
    assert_eq!(state(&h, "alice"), None);
    assert!(h.host.state().processes.is_empty());
    assert!(h.host.state().cgroups.is_empty());
    assert!(!dir.exists());
    assert!(h.svc.store().resources(None).unwrap().is_empty());
}

#[test]
fn limits_follow_the_spec() {
    let h = Harness::new(FaultHook::default());
    let mut s = spec("big", "{ kind = \"none\" }");
    s.vcpus = 4;
    s.memory_mib = 512;
    h.svc
        .execute(&Caller::Admin, TenantCommand::Create(s))
        .unwrap();
    h.svc.wait_idle();
    let jail = h.host.state().launched_with[0].clone();
    assert_eq!(jail.limits.memory_bytes, (512 + 64) << 20);
    assert_eq!(jail.limits.cpu_quota_us, 4 * jail.limits.cpu_period_us);
    assert_eq!(jail.uid, jail.gid);
    assert!(jail.uid >= 200_000);
}

#[test]
fn launch_limits_the_block_io_of_the_tenant_disk_only() {
    let h = Harness::new(FaultHook::default());
    create(&h, "nodisk");
    let mut s = spec("disky", "{ kind = \"none\" }");
    s.disk_gib = 1;
    s.quotas.disk_mib_per_s = 7;
    s.quotas.disk_iops = 300;
    h.svc
        .execute(&Caller::Admin, TenantCommand::Create(s))
        .unwrap();
    h.svc.wait_idle();
    assert_eq!(state(&h, "disky"), Some(LifecycleState::Running));
    let asked = h.host.state().block_io.clone();
    // Only the tenant with a disk asks, once, for its disk and its quotas.
    assert_eq!(asked.len(), 1, "{asked:?}");
    let (tenant, disks, limit) = &asked[0];
    assert_eq!(tenant, "disky");
    assert_eq!(
        disks,
        &vec![h.svc.config().tenant_dir("disky").join("disk.img")]
    );
    assert_eq!(limit.bytes_per_s, 7 << 20);
    assert_eq!(limit.ops_per_s, 300);
}

#[test]
fn tenant_tokens_cannot_see_or_act_on_others() {
    let h = Harness::new(FaultHook::default());
    create(&h, "alice");
    create(&h, "bob");
    h.svc.wait_idle();
    let alice_id = h.svc.store().tenant("alice").unwrap().unwrap().id;
    let alice = Caller::Tenant(alice_id);
    for cmd in [
        TenantCommand::Status("bob".into()),
        TenantCommand::Stop("bob".into()),
        TenantCommand::Destroy("bob".into()),
        TenantCommand::Logs("bob".into(), Default::default()),
        TenantCommand::Status("nobody".into()),
    ] {
        let err = h.svc.execute(&alice, cmd).unwrap_err();
        assert!(matches!(err, TenantServiceError::NotFound(_)), "{err}");
    }
    assert!(matches!(
        h.svc.execute(
            &alice,
            TenantCommand::Create(spec("eve", "{ kind = \"none\" }"))
        ),
        Err(TenantServiceError::AdminOnly(_))
    ));
    match h.svc.execute(&alice, TenantCommand::List).unwrap() {
        CommandOutcome::Tenants(l) => {
            assert_eq!(l.len(), 1);
            assert_eq!(l[0].record.name, "alice");
        }
        other => panic!("{other:?}"),
    }
    assert_eq!(state(&h, "bob"), Some(LifecycleState::Running));
    h.svc
        .execute(&alice, TenantCommand::Stop("alice".into()))
        .unwrap();
    h.svc.wait_idle();
    assert_eq!(state(&h, "alice"), Some(LifecycleState::Stopped));
}

#[test]
fn invalid_transitions_are_refused_and_change_nothing() {
    let h = Harness::new(FaultHook::default());
    create(&h, "alice");
    h.svc.wait_idle();
    let err = h
        .svc
        .execute(&Caller::Admin, TenantCommand::Start("alice".into()))
        .unwrap_err();
    assert!(err.to_string().contains("running"), "{err}");
    assert_eq!(state(&h, "alice"), Some(LifecycleState::Running));
}

#[test]
fn duplicate_names_are_refused() {
    let h = Harness::new(FaultHook::default());
    create(&h, "alice");
    h.svc.wait_idle();
    let err = h
        .svc
        .execute(
            &Caller::Admin,
            TenantCommand::Create(spec("alice", "{ kind = \"none\" }")),
        )
        .unwrap_err();
    assert!(err.to_string().contains("already exists"), "{err}");
    assert_eq!(h.svc.store().list_tenants(true).unwrap().len(), 1);
}

#[test]
fn missing_image_is_refused_before_anything_is_recorded() {
    let h = Harness::new(FaultHook::default());
    let s = TenantSpec::from_toml("name = \"a\"\n[image]\nname = \"nope\"\n").unwrap();
    let err = h
        .svc
        .execute(&Caller::Admin, TenantCommand::Create(s))
        .unwrap_err();
    assert!(matches!(err, TenantServiceError::Image(_)), "{err}");
    assert!(h.svc.store().list_tenants(true).unwrap().is_empty());
}

#[test]
fn a_failed_launch_leaves_a_failed_tenant_without_a_vm() {
    let h = Harness::new(FaultHook::default());
    h.host.state().fail_launch = true;
    create(&h, "alice");
    h.svc.wait_idle();
    let t = h.svc.store().tenant("alice").unwrap().unwrap();
    assert_eq!(t.state, LifecycleState::Failed);
    assert!(t.error.unwrap().contains("launch-vm"));
    assert!(h.host.state().processes.is_empty());
    h.svc
        .execute(&Caller::Admin, TenantCommand::Destroy("alice".into()))
        .unwrap();
    h.svc.wait_idle();
    assert!(h.svc.store().resources(None).unwrap().is_empty());
}

#[test]
fn gpu_requests_reserve_and_release_ledger_slots() {
    let h = Harness::new(FaultHook::default());
    h.svc
        .execute(
            &Caller::Admin,
            TenantCommand::Create(spec("a", "{ kind = \"whole\" }")),
        )
        .unwrap();
    h.svc.wait_idle();
    assert_eq!(h.svc.store().gpu_reservations().unwrap().len(), 8);
    h.svc
        .execute(
            &Caller::Admin,
            TenantCommand::Create(spec("b", "{ kind = \"mig\", profile = \"1g.10gb\" }")),
        )
        .unwrap();
    h.svc.wait_idle();
    let b = h.svc.store().tenant("b").unwrap().unwrap();
    assert_eq!(b.state, LifecycleState::Failed);
    assert!(b.error.unwrap().contains("taken"));
    h.svc
        .execute(&Caller::Admin, TenantCommand::Destroy("a".into()))
        .unwrap();
    h.svc.wait_idle();
    assert!(h.svc.store().gpu_reservations().unwrap().is_empty());
}

/// Every invariant a converged host satisfies: each process and cgroup belongs to a running
/// tenant and is recorded; nothing is held by a tenant that is gone.
fn assert_converged(h: &Harness) {
    let store = h.svc.store();
    let all = store.list_tenants(true).unwrap();
    for t in &all {
        assert!(!t.state.is_transient(), "{} left {}", t.name, t.state);
    }
    let running: Vec<_> = all
        .iter()
        .filter(|t| t.state == LifecycleState::Running)
        .collect();
    let host = h.host.state();
    let recorded: Vec<i32> = store
        .resources(None)
        .unwrap()
        .iter()
        .filter(|r| r.kind == ResourceKind::Process)
        .map(|r| r.key.split(':').next().unwrap().parse().unwrap())
        .collect();
    let mut alive: Vec<i32> = host.processes.keys().copied().collect();
    alive.sort_unstable();
    let mut rec = recorded.clone();
    rec.sort_unstable();
    assert_eq!(alive, rec, "orphan or missing VMM processes");
    assert_eq!(alive.len(), running.len());
    let cgroups: Vec<_> = host.cgroups.iter().cloned().collect();
    let mut names: Vec<_> = running.iter().map(|t| t.name.clone()).collect();
    names.sort();
    assert_eq!(cgroups, names, "orphan cgroups");
    for t in all.iter().filter(|t| t.state == LifecycleState::Destroyed) {
        assert!(
            store.resources(Some(t.id)).unwrap().is_empty(),
            "{} holds resources",
            t.name
        );
        assert!(store.gpu_placement(t.id).unwrap().is_none());
        assert!(!h.svc.config().tenant_dir(&t.name).exists());
    }
}

#[test]
fn create_converges_after_a_crash_at_every_step_boundary() {
    for step in Op::Create.steps() {
        for boundary in [Boundary::Before, Boundary::After] {
            let mut h = Harness::new(FaultHook::fail_at("create", step.name(), boundary));
            h.svc
                .execute(
                    &Caller::Admin,
                    TenantCommand::Create(spec("a", "{ kind = \"mig\", profile = \"2g.20gb\" }")),
                )
                .unwrap();
            h.svc.wait_idle();
            assert_eq!(
                state(&h, "a"),
                Some(LifecycleState::Provisioning),
                "{step:?} {boundary:?}"
            );
            h.restart(FaultHook::default());
            let report = reconcile(&h.svc, &ReconcileOptions::default()).unwrap();
            assert_eq!(report.resumed, vec!["a".to_string()]);
            assert_eq!(
                state(&h, "a"),
                Some(LifecycleState::Running),
                "{step:?} {boundary:?}"
            );
            assert_eq!(h.svc.store().gpu_reservations().unwrap().len(), 2);
            assert_converged(&h);
        }
    }
}

#[test]
fn destroy_converges_after_a_crash_at_every_step_boundary() {
    for step in Op::Destroy.steps() {
        for boundary in [Boundary::Before, Boundary::After] {
            let mut h = Harness::new(FaultHook::default());
            h.svc
                .execute(
                    &Caller::Admin,
                    TenantCommand::Create(spec("a", "{ kind = \"whole\" }")),
                )
                .unwrap();
            h.svc.wait_idle();
            h.restart(FaultHook::fail_at("destroy", step.name(), boundary));
            h.svc
                .execute(&Caller::Admin, TenantCommand::Destroy("a".into()))
                .unwrap();
            h.svc.wait_idle();
            h.restart(FaultHook::default());
            reconcile(&h.svc, &ReconcileOptions::default()).unwrap();
            assert_eq!(state(&h, "a"), None, "{step:?} {boundary:?}");
            assert!(h.svc.store().resources(None).unwrap().is_empty());
            assert!(h.svc.store().gpu_reservations().unwrap().is_empty());
            assert_converged(&h);
        }
    }
}

#[test]
fn a_row_without_a_guest_kind_gets_it_at_recovery_and_reads_write_nothing() {
    let mut h = Harness::new(FaultHook::default());
    create(&h, "old");
    h.svc.wait_idle();
    let t = h.svc.store().tenant("old").unwrap().unwrap();
    let stored = t.guest.expect("a new row has its guest kind");
    h.svc.store().forget_guest(t.id).unwrap();
    // Reading the tenant (what a GET route does) decides the kind but stores nothing.
    let t = h.svc.store().tenant("old").unwrap().unwrap();
    let loaded = Tenant::load(&h.svc.ctx(), &t).unwrap();
    assert_eq!(loaded.guest, stored);
    assert_eq!(h.svc.store().tenant("old").unwrap().unwrap().guest, None);
    // The daemon's start stores it, once, before any command reaches the tenant.
    h.restart(FaultHook::default());
    let plan = crate::reconcile::plan(&h.svc).unwrap();
    assert_eq!(
        h.svc.store().tenant("old").unwrap().unwrap().guest,
        Some(stored)
    );
    crate::reconcile::recover(&h.svc, plan, &ReconcileOptions::default()).unwrap();
}

#[test]
fn reconcile_adopts_live_vms_and_fails_dead_ones() {
    let mut h = Harness::new(FaultHook::default());
    create(&h, "alive");
    create(&h, "dead");
    h.svc.wait_idle();
    let dead_pid = h
        .host
        .state()
        .processes
        .iter()
        .find(|(_, t)| *t == "dead")
        .map(|(p, _)| *p)
        .unwrap();
    h.host.state().processes.remove(&dead_pid);
    h.restart(FaultHook::default());
    let report = reconcile(&h.svc, &ReconcileOptions::default()).unwrap();
    assert_eq!(report.adopted, vec!["alive".to_string()]);
    assert_eq!(report.failed, vec!["dead".to_string()]);
    assert_eq!(state(&h, "dead"), Some(LifecycleState::Failed));
    assert_converged(&h);
}

#[test]
fn reconcile_adopts_a_live_vmm_that_does_not_answer_and_says_so() {
    let mut h = Harness::new(FaultHook::default());
    create(&h, "paused");
    h.svc.wait_idle();
    let pid = h
        .host
        .state()
        .processes
        .iter()
        .find(|(_, t)| *t == "paused")
        .map(|(p, _)| *p)
        .unwrap();
    // Its process runs, its control socket is silent (a VMM paused for a while).
    h.host.state().unresponsive.insert(pid);
    h.restart(FaultHook::default());
    let report = reconcile(&h.svc, &ReconcileOptions::default()).unwrap();
    assert_eq!(report.adopted, vec!["paused".to_string()], "{report:?}");
    assert_eq!(state(&h, "paused"), Some(LifecycleState::Running));
    assert!(
        h.host.state().processes.contains_key(&pid),
        "the VM was killed"
    );
    let t = h.svc.store().tenant("paused").unwrap().unwrap();
    assert!(
        t.error
            .as_deref()
            .is_some_and(|e| e.starts_with("unresponsive")),
        "{:?}",
        t.error
    );
}

#[test]
fn reconcile_removes_unknown_cgroups_and_their_processes() {
    let mut h = Harness::new(FaultHook::default());
    {
        let mut host = h.host.state();
        host.cgroups.insert("stray".into());
        host.processes.insert(42, "stray".into());
    }
    h.restart(FaultHook::default());
    let kept = reconcile(
        &h.svc,
        &ReconcileOptions {
            sweep_unknown_cgroups: false,
        },
    )
    .unwrap();
    assert!(kept.cgroups_removed.is_empty());
    let report = reconcile(&h.svc, &ReconcileOptions::default()).unwrap();
    assert_eq!(report.cgroups_removed, vec!["stray".to_string()]);
    assert!(h.host.state().processes.is_empty());
}

#[test]
fn pending_tenants_are_rolled_back() {
    let mut h = Harness::new(FaultHook::default());
    h.svc
        .store()
        .insert_tenant(
            &spec("p", "{ kind = \"none\" }"),
            crate::domain::GuestKind::Plain,
        )
        .unwrap();
    h.restart(FaultHook::default());
    let report = reconcile(&h.svc, &ReconcileOptions::default()).unwrap();
    assert_eq!(report.rolled_back, vec!["p".to_string()]);
    assert_eq!(state(&h, "p"), None);
}

#[test]
fn a_vm_that_ends_on_its_own_turns_its_tenant_failed() {
    let h = Harness::new(FaultHook::default());
    create(&h, "alice");
    create(&h, "bob");
    h.svc.wait_idle();
    assert!(h.svc.check_vms().unwrap().is_empty());
    let pid = h
        .host
        .state()
        .processes
        .iter()
        .find(|(_, t)| *t == "alice")
        .map(|(p, _)| *p)
        .unwrap();
    h.host.state().processes.remove(&pid);
    assert_eq!(h.svc.check_vms().unwrap(), vec!["alice".to_string()]);
    let t = h.svc.store().tenant("alice").unwrap().unwrap();
    assert_eq!(t.state, LifecycleState::Failed);
    assert!(t.error.unwrap().contains("gone"));
    assert_eq!(state(&h, "bob"), Some(LifecycleState::Running));
    assert!(h
        .svc
        .store()
        .resources(Some(t.id))
        .unwrap()
        .iter()
        .all(|r| r.kind != ResourceKind::Process));
}

#[test]
fn infer_is_refused_for_unknown_foreign_and_agentless_tenants() {
    let h = Harness::new(FaultHook::default());
    for name in ["a", "b"] {
        create(&h, name);
    }
    h.svc.wait_idle();
    let body = serde_json::json!({"prompt": "secret prompt"});
    let infer = |caller: &Caller, name: &str| {
        h.svc
            .execute(caller, TenantCommand::Infer(name.into(), body.clone()))
            .unwrap_err()
    };
    assert!(matches!(
        infer(&Caller::Admin, "nobody"),
        TenantServiceError::NotFound(_)
    ));
    let a = h.svc.store().tenant("a").unwrap().unwrap();
    // Tenant a's token cannot reach b: answered like a missing tenant.
    assert!(matches!(
        infer(&Caller::Tenant(a.id), "b"),
        TenantServiceError::NotFound(_)
    ));
    // The test guest runs no agent: a clear refusal that never echoes the prompt.
    let err = infer(&Caller::Tenant(a.id), "a");
    assert!(matches!(err, TenantServiceError::BadRequest(_)), "{err}");
    assert!(
        err.to_string().contains("does not run a guest image"),
        "{err}"
    );
    assert!(!err.to_string().contains("secret prompt"));
}

#[test]
fn hostile_names_reach_no_tenant_through_any_command() {
    let h = Harness::new(FaultHook::default());
    create(&h, "alice");
    h.svc.wait_idle();
    let long = "a".repeat(64);
    for bad in [
        "", "../alice", "ALICE", "alice/", "alice\0", &long, "älice", ".",
    ] {
        for cmd in [
            TenantCommand::Status(bad.into()),
            TenantCommand::Stop(bad.into()),
            TenantCommand::Start(bad.into()),
            TenantCommand::Destroy(bad.into()),
            TenantCommand::Logs(bad.into(), Default::default()),
            TenantCommand::Infer(bad.into(), serde_json::json!({})),
        ] {
            let err = h.svc.execute(&Caller::Admin, cmd).unwrap_err();
            assert!(
                matches!(err, TenantServiceError::NotFound(_)),
                "{bad:?}: {err}"
            );
        }
    }
    assert_eq!(state(&h, "alice"), Some(LifecycleState::Running));
    // Nothing was created outside the tenants directory.
    let entries: Vec<_> = std::fs::read_dir(h.svc.config().tenants_dir())
        .unwrap()
        .map(|e| e.unwrap().file_name())
        .collect();
    assert_eq!(entries, vec![std::ffi::OsString::from("alice")]);
}

#[test]
fn the_guest_kind_is_decided_at_create_and_stored() {
    let h = Harness::new(FaultHook::default());
    create(&h, "alice");
    h.svc.wait_idle();
    let t = h.svc.store().tenant("alice").unwrap().unwrap();
    assert_eq!(t.guest, Some(crate::domain::GuestKind::Plain));
    // An image that later gains a manifest does not turn the tenant into an agent tenant:
    // the fact was decided at create.
    let images = h.dir.path().join("images/hello");
    std::fs::write(images.join("manifest.json"), "{}").unwrap();
    h.svc
        .execute(&Caller::Admin, TenantCommand::Stop("alice".into()))
        .unwrap();
    h.svc.wait_idle();
    h.svc
        .execute(&Caller::Admin, TenantCommand::Start("alice".into()))
        .unwrap();
    h.svc.wait_idle();
    assert_eq!(state(&h, "alice"), Some(LifecycleState::Running));
}

#[test]
fn the_service_answers_while_a_silent_tenant_is_recovered() {
    let mut h = Harness::new(FaultHook::default());
    create(&h, "slow");
    create(&h, "quick");
    h.svc.wait_idle();
    let slow_pid = h
        .host
        .state()
        .processes
        .iter()
        .find(|(_, t)| *t == "slow")
        .map(|(p, _)| *p)
        .unwrap();
    // After a restart, the slow tenant's VMM does not answer while it is checked.
    h.host.state().stalled.insert(slow_pid);
    h.restart(FaultHook::default());
    let plan = crate::reconcile::plan(&h.svc).unwrap();
    assert!(h.svc.recovering());
    let svc = h.svc.clone();
    let recovery = std::thread::spawn(move || {
        crate::reconcile::recover(&svc, plan, &ReconcileOptions::default()).unwrap()
    });
    let view = |name: &str| match h
        .svc
        .execute(&Caller::Admin, TenantCommand::Status(name.into()))
        .unwrap()
    {
        CommandOutcome::Tenant(v) => v,
        other => panic!("{other:?}"),
    };
    // The quick tenant is through; the slow one says it is still being recovered, with
    // its last recorded state, and commands on it say why they are refused.
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
    while view("quick").recovering {
        assert!(
            std::time::Instant::now() < deadline,
            "quick never recovered"
        );
        std::thread::sleep(std::time::Duration::from_millis(10));
    }
    let slow = view("slow");
    assert!(slow.recovering);
    assert_eq!(slow.record.state, LifecycleState::Running);
    let err = h
        .svc
        .execute(&Caller::Admin, TenantCommand::Stop("slow".into()))
        .unwrap_err();
    assert!(matches!(err, TenantServiceError::Recovering(_)), "{err}");
    assert!(err.to_string().contains("being recovered"), "{err}");
    assert!(h.svc.recovering());
    // The quick tenant takes commands meanwhile.
    h.svc
        .execute(&Caller::Admin, TenantCommand::Stop("quick".into()))
        .unwrap();
    h.host.state().stalled.clear();
    let report = recovery.join().unwrap();
    assert_eq!(
        report.adopted,
        vec!["quick".to_string(), "slow".to_string()]
    );
    assert!(!h.svc.recovering());
    assert!(!view("slow").recovering);
    h.svc.wait_idle();
    assert_eq!(state(&h, "quick"), Some(LifecycleState::Stopped));
}

#[test]
fn a_stop_request_ends_an_operation_waiting_on_a_silent_vm_as_a_crash_would() {
    let h =
        Harness::new(FaultHook::default()).with_boot_timeout(std::time::Duration::from_secs(300));
    h.host.state().launch_unresponsive = true;
    create(&h, "mute");
    // await-running waits (up to 300 s) for a VMM that never answers.
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
    loop {
        let t = h.svc.store().tenant("mute").unwrap().unwrap();
        let steps = h.svc.store().steps(t.op_id.unwrap()).unwrap();
        if steps.iter().any(|s| s.step == "await-running") {
            break;
        }
        assert!(std::time::Instant::now() < deadline, "{steps:?}");
        std::thread::sleep(std::time::Duration::from_millis(10));
    }
    let asked = std::time::Instant::now();
    h.svc.request_stop();
    assert!(
        h.svc.wait_idle_for(std::time::Duration::from_secs(5)),
        "the operation did not give up"
    );
    assert!(asked.elapsed() < std::time::Duration::from_secs(5));
    // Left as a crash leaves it: still provisioning, the step started, not failed.
    let t = h.svc.store().tenant("mute").unwrap().unwrap();
    assert_eq!(t.state, LifecycleState::Provisioning);
    assert_eq!(t.error, None);
    let steps = h.svc.store().steps(t.op_id.unwrap()).unwrap();
    let step = steps.iter().find(|s| s.step == "await-running").unwrap();
    assert_eq!(step.status, "started");
}

#[test]
fn checking_vms_reads_the_process_table_only_so_a_wedged_vmm_delays_no_one() {
    let h = Harness::new(FaultHook::default());
    create(&h, "wedged");
    create(&h, "crashed");
    h.svc.wait_idle();
    let pid_of = |name: &str| {
        h.host
            .state()
            .processes
            .iter()
            .find(|(_, t)| *t == name)
            .map(|(p, _)| *p)
            .unwrap()
    };
    let (wedged, crashed) = (pid_of("wedged"), pid_of("crashed"));
    {
        let mut host = h.host.state();
        // Asking this VMM anything blocks (for 30 s in the fake); its process lives.
        host.stalled.insert(wedged);
        host.unresponsive.insert(wedged);
        // The other tenant's VMM died on its own.
        host.processes.remove(&crashed);
        host.state_calls = 0;
    }
    let marked = h.svc.check_vms().unwrap();
    assert_eq!(marked, vec!["crashed".to_string()]);
    assert_eq!(state(&h, "crashed"), Some(LifecycleState::Failed));
    assert_eq!(state(&h, "wedged"), Some(LifecycleState::Running));
    let host = h.host.state();
    assert_eq!(host.state_calls, 0, "the check asked a VMM over its socket");
    assert!(host.ended_calls >= 2, "{}", host.ended_calls);
    drop(host);
    h.host.state().stalled.clear();
}

#[test]
fn gpu_steps_of_a_tenant_without_a_gpu_are_recorded_as_skipped_not_done() {
    let h = Harness::new(FaultHook::default());
    create(&h, "plain");
    h.svc
        .execute(
            &Caller::Admin,
            TenantCommand::Create(spec("gpu", "{ kind = \"mig\", profile = \"1g.10gb\" }")),
        )
        .unwrap();
    h.svc.wait_idle();
    let statuses = |name: &str| -> Vec<(String, String)> {
        let t = h.svc.store().tenant(name).unwrap().unwrap();
        h.svc
            .store()
            .steps(t.op_id.unwrap())
            .unwrap()
            .into_iter()
            .map(|s| (s.step, s.status))
            .collect()
    };
    let status_of = |all: &[(String, String)], step: &str| {
        all.iter()
            .find(|(s, _)| s == step)
            .map_or_else(|| panic!("no {step} in {all:?}"), |(_, st)| st.clone())
    };
    let plain = statuses("plain");
    for step in [
        "reserve-gpu",
        "create-gpu-instance",
        "bind-gpu",
        "attach-gpu",
    ] {
        assert_eq!(status_of(&plain, step), "skipped", "{plain:?}");
    }
    assert_eq!(status_of(&plain, "launch-vm"), "done");
    // The control: the same steps of a tenant with a GPU are done.
    let gpu = statuses("gpu");
    assert_eq!(status_of(&gpu, "reserve-gpu"), "done", "{gpu:?}");
    // A departure: the GPU steps its receipt records as skipped are skipped too.
    h.svc
        .execute(&Caller::Admin, TenantCommand::Destroy("plain".into()))
        .unwrap();
    h.svc.wait_idle();
    let t = h.svc.store().list_tenants(true).unwrap();
    let plain = t.iter().find(|t| t.name.as_str() == "plain").unwrap();
    let steps = h.svc.store().steps(plain.op_id.unwrap()).unwrap();
    let scrub = steps.iter().find(|s| s.step == "scrub-gpu").unwrap();
    assert_eq!(scrub.status, "skipped", "{steps:?}");
    let shred = steps.iter().find(|s| s.step == "remove-files").unwrap();
    assert_eq!(shred.status, "done", "{steps:?}");
}
