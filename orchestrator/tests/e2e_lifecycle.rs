//! End to end: a real tenantvmd runs three tenants on this machine's KVM (the no_std test
//! guest's `idle` test under tenantvm-vmm, jailed; the tiny idle ELF of
//! scripts/make-idle-guest.py when the test guests are not built): created concurrently,
//! then list, status, logs, stop, start and destroy through the API client the CLI uses.
//! Skips without root or /dev/kvm.

mod support;

use std::time::Duration;

use tenantvm::api::types::{LogQuery, LogStream};
use tenantvm::domain::lifecycle::LifecycleState;
use tenantvm::domain::spec::TenantSpec;

use support::daemon::{self, eventually, TestDaemon};

/// The image the tenants boot and the serial line that proves it runs.
fn image() -> (&'static str, &'static str) {
    if daemon::test_guest().is_some() {
        ("testguest", "TVMTEST idle READY")
    } else {
        eprintln!("note: target/test-guests/tvm-testguest not built (scripts/build-test-guests.sh); using the tiny idle ELF");
        ("idle", "hello from the idle guest")
    }
}

fn spec(name: &str) -> TenantSpec {
    let (img, _) = image();
    TenantSpec::from_toml(&format!(
        "name = \"{name}\"\nmemory_mib = 32\nvcpus = 1\n[image]\nname = \"{img}\"\n"
    ))
    .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn three_tenants_run_stop_start_and_destroy_under_kvm() {
    if daemon::should_skip("three_tenants_run_stop_start_and_destroy_under_kvm") {
        return;
    }
    let mut d = TestDaemon::new();
    d.start(None);
    let admin = d.admin();
    let names: Vec<String> = ["ann", "ben", "cat"]
        .iter()
        .map(|n| daemon::unique(n))
        .collect();

    // Created concurrently.
    let creates = names.iter().map(|n| {
        let admin = admin.clone();
        let s = spec(n);
        async move { admin.create(&s).await }
    });
    let created: Vec<_> = futures_join_all(creates).await;
    for c in &created {
        let c = c.as_ref().expect("create accepted");
        assert!(c.token.starts_with("tvm_"));
    }
    for n in &names {
        d.wait_state(n, LifecycleState::Running).await;
    }

    // list and status.
    let list = admin.list().await.unwrap();
    let mut listed: Vec<_> = list.tenants.iter().map(|t| t.name.clone()).collect();
    listed.sort();
    let mut want = names.clone();
    want.sort();
    assert_eq!(listed, want);
    let mut uids = std::collections::HashSet::new();
    for n in &names {
        let t = admin.status(n).await.unwrap();
        let pid = t.pid.expect("running tenant has a VMM pid");
        assert!(uids.insert(t.uid.unwrap()), "uids must differ");
        let members = daemon::processes_in_cgroup_of(n);
        assert!(
            members.contains(&pid),
            "VMM pid {pid} not in the cgroup of {n}: {members:?}"
        );
        assert!(daemon::cgroup_exists(n));
    }

    // logs: the guest's serial line, the events of its creation.
    let first = &names[0];
    let ok = eventually(Duration::from_secs(20), || {
        let admin = admin.clone();
        let first = first.clone();
        async move {
            admin
                .logs(&first, &LogQuery::default())
                .await
                .is_ok_and(|c| c.text.contains(image().1))
        }
    })
    .await;
    assert!(ok, "serial log lacks the guest's line");
    let events = admin
        .logs(
            first,
            &LogQuery {
                stream: LogStream::Events,
                ..Default::default()
            },
        )
        .await
        .unwrap();
    assert!(
        events.text.contains("provisioning -> running"),
        "{}",
        events.text
    );

    // stop and start the second.
    let second = &names[1];
    admin.stop(second).await.unwrap();
    d.wait_state(second, LifecycleState::Stopped).await;
    assert!(
        daemon::processes_in_cgroup_of(second).is_empty(),
        "stopped tenant keeps a process"
    );
    admin.start(second).await.unwrap();
    d.wait_state(second, LifecycleState::Running).await;

    // destroy all; nothing is left.
    for n in &names {
        admin.destroy(n).await.unwrap();
    }
    for n in &names {
        let ok = d.forgets(n, Duration::from_secs(60)).await;
        assert!(ok, "{n} not destroyed:\n{}", d.log());
        assert!(daemon::processes_in_cgroup_of(n).is_empty());
        assert!(!daemon::cgroup_exists(n), "cgroup of {n} left behind");
        assert!(!d.state_dir().join("tenants").join(n).exists());
    }
    assert!(admin.list().await.unwrap().tenants.is_empty());
    assert!(d.store().resources(None).unwrap().is_empty());
    d.stop();
}

/// Awaits all futures concurrently (tokio tasks, no extra crate).
async fn futures_join_all<F, T>(futs: impl Iterator<Item = F>) -> Vec<T>
where
    F: std::future::Future<Output = T> + Send + 'static,
    T: Send + 'static,
{
    let handles: Vec<_> = futs.map(tokio::spawn).collect();
    let mut out = Vec::new();
    for h in handles {
        out.push(h.await.unwrap());
    }
    out
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_vm_that_ends_behind_the_daemons_back_turns_its_tenant_failed() {
    if daemon::should_skip("a_vm_that_ends_behind_the_daemons_back_turns_its_tenant_failed") {
        return;
    }
    let mut d = TestDaemon::new();
    d.start(None);
    let admin = d.admin();
    let name = daemon::unique("gone");
    let s = TenantSpec::from_toml(&format!(
        "name = \"{name}\"\nmemory_mib = 32\n[image]\nname = \"idle\"\n"
    ))
    .unwrap();
    admin.create(&s).await.unwrap();
    d.wait_state(&name, LifecycleState::Running).await;
    // Stop the VMM through its own control socket, not through the daemon.
    let sock = d
        .state_dir()
        .join("tenants")
        .join(&name)
        .join("run/api.sock");
    let mut stream = tokio::net::UnixStream::connect(&sock).await.unwrap();
    tokio::io::AsyncWriteExt::write_all(&mut stream, b"{\"command\":\"shutdown\"}\n")
        .await
        .unwrap();
    d.wait_state(&name, LifecycleState::Failed).await;
    let t = admin.status(&name).await.unwrap();
    assert!(
        t.error.as_deref().unwrap_or("").contains("on its own"),
        "{t:?}"
    );
    assert!(t.pid.is_none());
    admin.destroy(&name).await.unwrap();
    let gone = d.forgets(&name, Duration::from_secs(30)).await;
    assert!(gone);
    assert!(!daemon::cgroup_exists(&name));
    d.stop();
}
