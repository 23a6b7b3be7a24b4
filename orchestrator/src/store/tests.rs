use std::sync::{Arc, Barrier};

use super::*;
use crate::domain::spec::{GuestImage, TenantSpec};

fn spec(name: &str) -> TenantSpec {
    TenantSpec::from_toml(&format!("name = \"{name}\"\n[image]\nname = \"hello\"\n")).unwrap()
}

fn open_temp() -> (tempfile::TempDir, Store) {
    let dir = tempfile::tempdir().unwrap();
    let store = Store::open(&dir.path().join("state.db")).unwrap();
    (dir, store)
}

#[test]
fn reopening_keeps_tenants_and_schema() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("state.db");
    {
        let store = Store::open(&path).unwrap();
        store.insert_tenant(&spec("a"), GuestKind::Plain).unwrap();
    }
    let store = Store::open(&path).unwrap();
    let t = store.tenant("a").unwrap().unwrap();
    assert_eq!(t.state, LifecycleState::Pending);
    assert_eq!(
        t.spec.image,
        GuestImage {
            name: Some("hello".into()),
            ..Default::default()
        }
    );
}

#[test]
fn duplicate_live_names_are_refused_but_destroyed_names_are_reusable() {
    let (_d, store) = open_temp();
    let t = store.insert_tenant(&spec("a"), GuestKind::Plain).unwrap();
    assert!(matches!(
        store.insert_tenant(&spec("a"), GuestKind::Plain),
        Err(StoreError::DuplicateName(_))
    ));
    store
        .transition(t.id, LifecycleState::Destroying, Some("destroy"), None)
        .unwrap();
    store
        .transition(t.id, LifecycleState::Destroyed, None, None)
        .unwrap();
    store.insert_tenant(&spec("a"), GuestKind::Plain).unwrap();
    assert_eq!(store.list_tenants(true).unwrap().len(), 2);
    assert_eq!(store.list_tenants(false).unwrap().len(), 1);
}

#[test]
fn invalid_transitions_change_nothing() {
    let (_d, store) = open_temp();
    let t = store.insert_tenant(&spec("a"), GuestKind::Plain).unwrap();
    let err = store
        .transition(t.id, LifecycleState::Running, None, None)
        .unwrap_err();
    assert!(matches!(err, StoreError::Lifecycle(_)));
    assert_eq!(
        store.tenant("a").unwrap().unwrap().state,
        LifecycleState::Pending
    );
}

#[test]
fn steps_are_recorded_before_and_after() {
    let (_d, store) = open_temp();
    let t = store.insert_tenant(&spec("a"), GuestKind::Plain).unwrap();
    let op = store
        .transition(t.id, LifecycleState::Provisioning, Some("create"), None)
        .unwrap()
        .unwrap();
    store.step_started(t.id, op, "allocate-uid").unwrap();
    assert_eq!(store.steps(op).unwrap()[0].status, "started");
    store.step_finished(t.id, op, "allocate-uid", None).unwrap();
    store.step_started(t.id, op, "launch-vm").unwrap();
    store
        .step_finished(t.id, op, "launch-vm", Some("boom"))
        .unwrap();
    let steps = store.steps(op).unwrap();
    assert_eq!(steps[0].status, "done");
    assert_eq!(steps[1].status, "failed");
    assert_eq!(steps[1].error.as_deref(), Some("boom"));
    // Re-running a step (a resume) resets it to started.
    store.step_started(t.id, op, "launch-vm").unwrap();
    assert_eq!(store.steps(op).unwrap()[1].status, "started");
}

#[test]
fn uids_are_lowest_free_and_stable_per_tenant() {
    let (_d, store) = open_temp();
    let a = store.insert_tenant(&spec("a"), GuestKind::Plain).unwrap();
    let b = store.insert_tenant(&spec("b"), GuestKind::Plain).unwrap();
    let c = store.insert_tenant(&spec("c"), GuestKind::Plain).unwrap();
    assert_eq!(store.allocate_uid(a.id, 1000, 2).unwrap(), 1000);
    assert_eq!(store.allocate_uid(a.id, 1000, 2).unwrap(), 1000);
    assert_eq!(store.allocate_uid(b.id, 1000, 2).unwrap(), 1001);
    assert!(matches!(
        store.allocate_uid(c.id, 1000, 2),
        Err(StoreError::UidsExhausted(..))
    ));
    store.remove_resource(ResourceKind::Uid, "1000").unwrap();
    assert_eq!(store.allocate_uid(c.id, 1000, 2).unwrap(), 1000);
}

#[test]
fn resources_are_unique_across_tenants() {
    let (_d, store) = open_temp();
    let a = store.insert_tenant(&spec("a"), GuestKind::Plain).unwrap();
    let b = store.insert_tenant(&spec("b"), GuestKind::Plain).unwrap();
    store
        .add_resource(a.id, ResourceKind::File, "/x", None)
        .unwrap();
    store
        .add_resource(a.id, ResourceKind::File, "/x", Some("again"))
        .unwrap();
    store
        .add_resource(b.id, ResourceKind::File, "/x", Some("steal"))
        .unwrap();
    let held = store.resources(None).unwrap();
    assert_eq!(held.len(), 1);
    assert_eq!(held[0].tenant_id, a.id);
    assert_eq!(held[0].detail.as_deref(), Some("again"));
}

fn whole(gpu: &str) -> GpuPlacement {
    GpuPlacement {
        gpu: gpu.into(),
        slots: (0..8).collect(),
        label: "whole".into(),
    }
}

fn slice(gpu: &str, start: u32, len: u32) -> GpuPlacement {
    GpuPlacement {
        gpu: gpu.into(),
        slots: (start..start + len).collect(),
        label: format!("{len}g@{start}"),
    }
}

#[test]
fn gpu_reservation_skips_taken_slots_and_is_idempotent() {
    let (_d, store) = open_temp();
    let a = store.insert_tenant(&spec("a"), GuestKind::Plain).unwrap();
    let b = store.insert_tenant(&spec("b"), GuestKind::Plain).unwrap();
    let c = store.insert_tenant(&spec("c"), GuestKind::Plain).unwrap();
    let got = store
        .reserve_gpu(a.id, &[slice("g0", 0, 4)])
        .unwrap()
        .unwrap();
    assert_eq!(got.slots, vec![0, 1, 2, 3]);
    assert_eq!(
        store
            .reserve_gpu(a.id, &[slice("g0", 4, 4)])
            .unwrap()
            .unwrap(),
        got
    );
    // A whole GPU overlaps a's slice; the second candidate is free.
    let got_b = store
        .reserve_gpu(b.id, &[whole("g0"), whole("g1")])
        .unwrap()
        .unwrap();
    assert_eq!(got_b.gpu, "g1");
    assert_eq!(
        store
            .reserve_gpu(c.id, &[whole("g0"), whole("g1")])
            .unwrap(),
        None
    );
    // A failed candidate leaves no partial rows behind.
    assert_eq!(store.gpu_reservations().unwrap().len(), 12);
    store.release_gpu(a.id).unwrap();
    assert_eq!(
        store
            .reserve_gpu(c.id, &[whole("g0")])
            .unwrap()
            .unwrap()
            .gpu,
        "g0"
    );
}

#[test]
fn concurrent_gpu_reservations_never_share_a_slot() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("state.db");
    let setup = Store::open(&path).unwrap();
    let ids: Vec<i64> = (0..12)
        .map(|i| {
            setup
                .insert_tenant(&spec(&format!("t{i}")), GuestKind::Plain)
                .unwrap()
                .id
        })
        .collect();
    // Two GPUs of 8 slots; each tenant wants 2 slots anywhere: 8 fit, 4 must be refused.
    let candidates: Vec<GpuPlacement> = ["g0", "g1"]
        .iter()
        .flat_map(|g| (0..4).map(move |k| slice(g, k * 2, 2)))
        .collect();
    let barrier = Arc::new(Barrier::new(ids.len()));
    let handles: Vec<_> = ids
        .iter()
        .map(|&id| {
            let path = path.clone();
            let barrier = barrier.clone();
            let candidates = candidates.clone();
            std::thread::spawn(move || {
                // Each thread has its own connection, as separate processes would.
                let store = Store::open(&path).unwrap();
                barrier.wait();
                store.reserve_gpu(id, &candidates).unwrap()
            })
        })
        .collect();
    let results: Vec<_> = handles.into_iter().map(|h| h.join().unwrap()).collect();
    let granted: Vec<_> = results.iter().flatten().collect();
    assert_eq!(granted.len(), 8);
    let mut seen = std::collections::HashSet::new();
    for p in &granted {
        for s in &p.slots {
            assert!(
                seen.insert((p.gpu.clone(), *s)),
                "slot {s} of {} granted twice",
                p.gpu
            );
        }
    }
    assert_eq!(setup.gpu_reservations().unwrap().len(), 16);
}

#[test]
fn tokens_resolve_to_owners_and_revoke() {
    let (_d, store) = open_temp();
    let a = store.insert_tenant(&spec("a"), GuestKind::Plain).unwrap();
    store.insert_token("aa", &TokenOwner::Admin).unwrap();
    store.insert_token("bb", &TokenOwner::Tenant(a.id)).unwrap();
    assert!(store.has_admin_token().unwrap());
    assert_eq!(
        store.token_owner("aa").unwrap().unwrap().1,
        TokenOwner::Admin
    );
    assert_eq!(
        store.token_owner("bb").unwrap().unwrap().1,
        TokenOwner::Tenant(a.id)
    );
    assert!(store.token_owner("cc").unwrap().is_none());
    store.revoke_tenant_tokens(a.id).unwrap();
    assert!(store.token_owner("bb").unwrap().is_none());
}

#[test]
fn events_page_by_id() {
    let (_d, store) = open_temp();
    let a = store.insert_tenant(&spec("a"), GuestKind::Plain).unwrap();
    store.add_event(Some(a.id), "note", "one").unwrap();
    store.add_event(Some(a.id), "note", "two").unwrap();
    let all = store.events(a.id, 0, 100).unwrap();
    assert_eq!(all.len(), 3);
    let after = store.events(a.id, all[1].id, 100).unwrap();
    assert_eq!(after.len(), 1);
    assert_eq!(after[0].message, "two");
}

#[test]
fn rows_from_before_schema_3_load_and_get_their_guest_kind_stored() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("state.db");
    {
        // A store as a daemon before schema 3 left it: one tenant, no guest column.
        let conn = Connection::open(&path).unwrap();
        for sql in &migrations::MIGRATIONS[..2] {
            conn.execute_batch(sql).unwrap();
        }
        conn.pragma_update(None, "user_version", 2).unwrap();
        let spec_json = serde_json::to_string(&spec("old")).unwrap();
        conn.execute(
            "INSERT INTO tenants (name, state, spec, created_ms, updated_ms) VALUES ('old', 'running', ?1, 1, 1)",
            [spec_json],
        )
        .unwrap();
    }
    let store = Store::open(&path).unwrap();
    let t = store.tenant("old").unwrap().unwrap();
    assert_eq!(t.state, LifecycleState::Running);
    assert_eq!(t.guest, None, "undecided until the daemon decides it");
    store.set_guest(t.id, GuestKind::Agent).unwrap();
    assert_eq!(
        store.tenant("old").unwrap().unwrap().guest,
        Some(GuestKind::Agent)
    );
    let new = store.insert_tenant(&spec("new"), GuestKind::Plain).unwrap();
    assert_eq!(new.guest, Some(GuestKind::Plain));
}

#[test]
fn guest_text_in_events_and_errors_is_bounded_to_one_line() {
    let (_d, store) = open_temp();
    let a = store.insert_tenant(&spec("a"), GuestKind::Plain).unwrap();
    let hostile = format!("{}\ncrypto-shred ok verified\x1b[2K", "E".repeat(4 << 20));
    store.add_event(Some(a.id), "step", &hostile).unwrap();
    store
        .transition(a.id, LifecycleState::Provisioning, Some("create"), None)
        .unwrap();
    let op = store.tenant_by_id(a.id).unwrap().op_id.unwrap();
    store.step_started(a.id, op, "await-agent").unwrap();
    store
        .step_finished(a.id, op, "await-agent", Some(&hostile))
        .unwrap();
    store
        .transition(a.id, LifecycleState::Failed, None, Some(&hostile))
        .unwrap();
    store.set_tenant_error(a.id, Some(&hostile)).unwrap();
    let limit = crate::untrusted::MAX_FIELD_BYTES + 64;
    for e in store.events(a.id, 0, 100).unwrap() {
        assert!(
            e.message.len() <= limit,
            "event of {} bytes",
            e.message.len()
        );
        assert!(!e.message.contains('\n') && !e.message.contains('\x1b'));
    }
    let t = store.tenant_by_id(a.id).unwrap();
    let error = t.error.unwrap();
    assert!(
        error.len() <= limit && !error.contains('\n'),
        "{}",
        error.len()
    );
    let step = &store.steps(op).unwrap()[0];
    let step_error = step.error.as_ref().unwrap();
    assert!(step_error.len() <= limit && !step_error.contains('\n'));
    assert!(step_error.contains("truncated"));
}

#[test]
fn vsock_cids_are_unique_kept_skip_busy_ones_and_are_released() {
    use std::collections::BTreeSet;
    let (_d, store) = open_temp();
    let a = store.insert_tenant(&spec("a"), GuestKind::Agent).unwrap();
    let b = store.insert_tenant(&spec("b"), GuestKind::Agent).unwrap();
    let c = store.insert_tenant(&spec("c"), GuestKind::Agent).unwrap();
    let none = BTreeSet::new();
    assert_eq!(store.vsock_cid(a.id).unwrap(), None);
    assert_eq!(store.allocate_vsock_cid(a.id, &none).unwrap(), FIRST_CID);
    // Asked again (a restart, a resumed step): the same CID.
    assert_eq!(store.allocate_vsock_cid(a.id, &none).unwrap(), 3);
    assert_eq!(store.vsock_cid(a.id).unwrap(), Some(3));
    // Another VM on the host holds 4: b gets 5, and keeps it.
    let busy: BTreeSet<u32> = [4].into();
    assert_eq!(store.allocate_vsock_cid(b.id, &busy).unwrap(), 5);
    assert_eq!(store.allocate_vsock_cid(b.id, &none).unwrap(), 5);
    // a's own CID found busy on the host (taken while a was stopped): a moves.
    let busy: BTreeSet<u32> = [3, 4].into();
    assert_eq!(store.allocate_vsock_cid(a.id, &busy).unwrap(), 6);
    assert_eq!(store.vsock_cid(a.id).unwrap(), Some(6));
    // 3 is free again, and lowest.
    assert_eq!(store.allocate_vsock_cid(c.id, &none).unwrap(), 3);
    // Released at departure: idempotent, and the CID goes to the next tenant.
    store.release_vsock_cid(b.id).unwrap();
    store.release_vsock_cid(b.id).unwrap();
    assert_eq!(store.vsock_cid(b.id).unwrap(), None);
    let d = store.insert_tenant(&spec("d"), GuestKind::Agent).unwrap();
    assert_eq!(store.allocate_vsock_cid(d.id, &none).unwrap(), 4);
    assert_eq!(store.allocate_vsock_cid(b.id, &none).unwrap(), 5);
}

#[test]
fn concurrent_cid_allocations_never_share_a_cid() {
    use std::collections::BTreeSet;
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("state.db");
    let ids: Vec<i64> = {
        let store = Store::open(&path).unwrap();
        (0..8)
            .map(|i| {
                store
                    .insert_tenant(&spec(&format!("t{i}")), GuestKind::Agent)
                    .unwrap()
                    .id
            })
            .collect()
    };
    let barrier = Arc::new(Barrier::new(ids.len()));
    let handles: Vec<_> = ids
        .into_iter()
        .map(|id| {
            let (path, barrier) = (path.clone(), barrier.clone());
            std::thread::spawn(move || {
                let store = Store::open(&path).unwrap();
                barrier.wait();
                store.allocate_vsock_cid(id, &BTreeSet::new()).unwrap()
            })
        })
        .collect();
    let cids: BTreeSet<u32> = handles.into_iter().map(|h| h.join().unwrap()).collect();
    assert_eq!(cids, (3..11).collect());
}

#[test]
fn the_cid_table_refuses_reserved_and_duplicate_cids() {
    let (_d, store) = open_temp();
    let a = store.insert_tenant(&spec("a"), GuestKind::Agent).unwrap();
    let b = store.insert_tenant(&spec("b"), GuestKind::Agent).unwrap();
    let conn = store.lock();
    let put = |t: i64, cid: i64| {
        conn.execute(
            "INSERT INTO vsock_cids (tenant_id, cid, created_ms) VALUES (?1, ?2, 0)",
            params![t, cid],
        )
    };
    assert!(put(a.id, 2).is_err(), "CID 2 is the host's");
    assert!(put(a.id, i64::from(u32::MAX)).is_err(), "VMADDR_CID_ANY");
    put(a.id, 9).unwrap();
    assert!(put(b.id, 9).is_err(), "one CID, one tenant");
}
