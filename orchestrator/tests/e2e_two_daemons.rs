//! Two tenantvmd on one host, each with its own state directory, never touch each other's
//! tenants: same-named tenants live in separate cgroup subtrees
//! (`tenantvm/<hash of the state dir>/<name>`), destroying one leaves the other running,
//! and a daemon's start-up sweep of leaked cgroups stays inside its own subtree. Real
//! daemons, the idle test guest under tenantvm-vmm on KVM. Skips without root or /dev/kvm.

mod support;

use std::time::Duration;

use tenantvm::domain::lifecycle::LifecycleState;
use tenantvm::domain::spec::TenantSpec;

use support::daemon::{self, TestDaemon};

fn spec(name: &str) -> TenantSpec {
    TenantSpec::from_toml(&format!(
        "name = \"{name}\"\nmemory_mib = 32\nvcpus = 1\n[image]\nname = \"idle\"\n"
    ))
    .unwrap()
}

async fn running(d: &TestDaemon, name: &str) -> bool {
    d.admin()
        .status(name)
        .await
        .is_ok_and(|t| t.state == LifecycleState::Running)
}

/// The VMM pid a daemon recorded for `name`, checked to be alive.
async fn live_pid(d: &TestDaemon, name: &str) -> i32 {
    let t = d.admin().status(name).await.unwrap();
    let pid = t.pid.expect("a running tenant has a pid");
    assert!(
        std::path::Path::new(&format!("/proc/{pid}")).exists(),
        "{name}'s VMM {pid} is gone"
    );
    pid
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_daemons_with_same_named_tenants_never_touch_each_other() {
    if daemon::should_skip("two_daemons_with_same_named_tenants_never_touch_each_other") {
        return;
    }
    let mut a = TestDaemon::new();
    let mut b = TestDaemon::new();
    a.start(None);
    b.start(None);
    let twin = daemon::unique("twin");
    a.admin().create(&spec(&twin)).await.expect("a creates");
    a.wait_state(&twin, LifecycleState::Running).await;
    b.admin()
        .create(&spec(&twin))
        .await
        .expect("b creates a tenant of the same name");
    b.wait_state(&twin, LifecycleState::Running).await;
    let a_pid = live_pid(&a, &twin).await;
    let b_pid = live_pid(&b, &twin).await;
    assert_ne!(a_pid, b_pid);

    // Destroying a's twin leaves b's running, through b's next VM checks too.
    a.admin().destroy(&twin).await.unwrap();
    let gone = a.forgets(&twin, Duration::from_secs(60)).await;
    assert!(gone, "a's destroy did not finish:\n{}", a.log());
    tokio::time::sleep(Duration::from_secs(3)).await;
    assert!(running(&b, &twin).await, "b's twin was hurt:\n{}", b.log());
    assert_eq!(live_pid(&b, &twin).await, b_pid);

    // A daemon's start-up sweep of unknown cgroups stays in its own subtree.
    let only_a = daemon::unique("onlya");
    a.admin().create(&spec(&only_a)).await.unwrap();
    a.wait_state(&only_a, LifecycleState::Running).await;
    let only_a_pid = live_pid(&a, &only_a).await;
    b.stop();
    b.start(None);
    assert!(
        running(&a, &only_a).await,
        "b's restart hurt a:\n{}",
        b.log()
    );
    assert_eq!(live_pid(&a, &only_a).await, only_a_pid);
    b.wait_state(&twin, LifecycleState::Running).await;
    assert_eq!(live_pid(&b, &twin).await, b_pid, "b adopts its own VM");

    a.admin().destroy(&only_a).await.unwrap();
    b.admin().destroy(&twin).await.unwrap();
    for (d, n) in [(&a, &only_a), (&b, &twin)] {
        let gone = d.forgets(n, Duration::from_secs(60)).await;
        assert!(gone, "{n} was not destroyed:\n{}", d.log());
        assert!(!daemon::cgroup_exists(n), "cgroup of {n} left behind");
    }
    a.stop();
    b.stop();
}
