//! Crash safety, systematically: for every step of create and of destroy, and for both
//! sides of it, a real tenantvmd SIGKILLs itself at that boundary
//! (TENANTVM_TEST_CRASH_AT=<op>:<step>:<before|after>); a fresh daemon then reconciles, and
//! the host must have converged: the tenant running (create) or gone (destroy), with no
//! orphan VMM process, cgroup, uid, file, GPU reservation or MIG instance. GPU steps use
//! the simulated host (tests/fixtures/hosts/sim-mixed.json). Skips without root or /dev/kvm.

mod support;

use std::os::unix::process::ExitStatusExt;
use std::path::{Path, PathBuf};
use std::time::Duration;

use tenantvm::domain::lifecycle::LifecycleState;
use tenantvm::domain::spec::TenantSpec;
use tenantvm::store::ResourceKind;
use tenantvm::tenant::steps::Op;

use support::daemon::{self, TestDaemon};

const MIG_PROFILE: &str = "1g.18gb";

fn spec(name: &str) -> TenantSpec {
    TenantSpec::from_toml(&format!(
        "name = \"{name}\"\nmemory_mib = 32\ngpu = {{ kind = \"mig\", profile = \"{MIG_PROFILE}\" }}\n[image]\nname = \"idle\"\n"
    ))
    .unwrap()
}

/// A daemon over a private copy of the simulated GPU host.
fn daemon_with_sim() -> (TestDaemon, PathBuf) {
    TestDaemon::new().with_sim_gpu_host()
}

/// MIG instances of our profile on the simulated host.
fn sim_instances(sim: &Path) -> usize {
    let host: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(sim).unwrap()).unwrap();
    host["gpus"]
        .as_array()
        .unwrap()
        .iter()
        .flat_map(|g| g["instances"].as_array().unwrap().iter())
        .filter(|i| i["profile"] == MIG_PROFILE)
        .count()
}

/// The tenant runs with exactly one of everything.
fn assert_running_converged(d: &TestDaemon, sim: &Path, name: &str, case: &str) {
    let store = d.store();
    let t = store
        .tenant(name)
        .unwrap()
        .unwrap_or_else(|| panic!("{case}: tenant gone\n{}", d.log()));
    assert_eq!(
        t.state,
        LifecycleState::Running,
        "{case}: {:?}\n{}",
        t.error,
        d.log()
    );
    let held = store.resources(Some(t.id)).unwrap();
    for kind in [
        ResourceKind::Uid,
        ResourceKind::File,
        ResourceKind::Cgroup,
        ResourceKind::Process,
    ] {
        let n = held.iter().filter(|r| r.kind == kind).count();
        assert_eq!(n, 1, "{case}: {kind:?} held {n} times: {held:?}");
    }
    let pid: i32 = held
        .iter()
        .find(|r| r.kind == ResourceKind::Process)
        .unwrap()
        .key
        .split(':')
        .next()
        .unwrap()
        .parse()
        .unwrap();
    let members = daemon::processes_in_cgroup_of(name);
    assert!(
        members.contains(&pid),
        "{case}: recorded VMM {pid} not in cgroup {members:?}"
    );
    let uid: u32 = held
        .iter()
        .find(|r| r.kind == ResourceKind::Uid)
        .unwrap()
        .key
        .parse()
        .unwrap();
    for p in daemon::processes_of_uid(uid) {
        assert!(
            members.contains(&p),
            "{case}: process {p} of uid {uid} outside the tenant cgroup"
        );
    }
    assert!(
        store.gpu_placement(t.id).unwrap().is_some(),
        "{case}: no reservation"
    );
    assert_eq!(store.gpu_reservations().unwrap().len(), 1, "{case}: ledger");
    assert_eq!(sim_instances(sim), 1, "{case}: MIG instances");
}

/// Nothing of the tenant is left anywhere.
fn assert_gone(d: &TestDaemon, sim: &Path, name: &str, uid: Option<u32>, case: &str) {
    let store = d.store();
    assert!(
        store.tenant(name).unwrap().is_none(),
        "{case}: tenant still live\n{}",
        d.log()
    );
    assert!(
        store.resources(None).unwrap().is_empty(),
        "{case}: {:?}",
        store.resources(None).unwrap()
    );
    assert!(
        store.gpu_reservations().unwrap().is_empty(),
        "{case}: ledger not empty"
    );
    assert_eq!(sim_instances(sim), 0, "{case}: MIG instance left");
    assert!(
        daemon::processes_in_cgroup_of(name).is_empty(),
        "{case}: orphan process"
    );
    assert!(!daemon::cgroup_exists(name), "{case}: orphan cgroup");
    if let Some(uid) = uid {
        assert!(
            daemon::processes_of_uid(uid).is_empty(),
            "{case}: process of uid {uid} left"
        );
    }
    assert!(
        !d.state_dir().join("tenants").join(name).exists(),
        "{case}: tenant dir left"
    );
}

fn crash_and_restart(d: &mut TestDaemon, case: &str) {
    let status = d.wait_for_death(Duration::from_secs(60));
    assert_eq!(
        status.signal(),
        Some(libc::SIGKILL),
        "{case}: daemon ended with {status}\n{}",
        d.log()
    );
    // start() waits for the recovery that runs once the socket is up.
    d.start(None);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn create_converges_after_sigkill_at_every_step_boundary() {
    if daemon::should_skip("create_converges_after_sigkill_at_every_step_boundary")
        || daemon::skip_without_crash_hook("create_converges_after_sigkill_at_every_step_boundary")
    {
        return;
    }
    for (i, step) in Op::Create.steps().iter().enumerate() {
        for boundary in ["before", "after"] {
            let case = format!("create:{}:{boundary}", step.name());
            let name = daemon::unique(&format!("cc{i}{}", &boundary[..1]));
            let (mut d, sim) = daemon_with_sim();
            d.start(Some(&case));
            // The answer may or may not arrive before the daemon dies.
            let answer = d.admin().create(&spec(&name)).await;
            eprintln!(
                "{case}: create answered {:?}",
                answer.map(|c| c.tenant.state)
            );
            crash_and_restart(&mut d, &case);
            assert_running_converged(&d, &sim, &name, &case);
            let uid = d.admin().status(&name).await.unwrap().uid;
            d.admin().destroy(&name).await.unwrap();
            let gone = d.forgets(&name, Duration::from_secs(60)).await;
            assert!(gone, "{case}: destroy after recovery did not finish");
            assert_gone(&d, &sim, &name, uid, &case);
            d.stop();
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn destroy_converges_after_sigkill_at_every_step_boundary() {
    if daemon::should_skip("destroy_converges_after_sigkill_at_every_step_boundary")
        || daemon::skip_without_crash_hook("destroy_converges_after_sigkill_at_every_step_boundary")
    {
        return;
    }
    for (i, step) in Op::Destroy.steps().iter().enumerate() {
        for boundary in ["before", "after"] {
            let case = format!("destroy:{}:{boundary}", step.name());
            let name = daemon::unique(&format!("cd{i}{}", &boundary[..1]));
            let (mut d, sim) = daemon_with_sim();
            d.start(None);
            d.admin().create(&spec(&name)).await.unwrap();
            let running = d
                .reaches(&name, LifecycleState::Running, Duration::from_secs(60))
                .await;
            assert!(running, "{case}: tenant did not start\n{}", d.log());
            let uid = d.admin().status(&name).await.unwrap().uid;
            d.stop();
            d.start(Some(&case));
            let answer = d.admin().destroy(&name).await;
            eprintln!("{case}: destroy answered {:?}", answer.map(|t| t.state));
            crash_and_restart(&mut d, &case);
            assert_gone(&d, &sim, &name, uid, &case);
            d.stop();
        }
    }
}
