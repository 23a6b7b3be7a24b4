//! `GET /v1/metrics` with the disk and GPU series: two tenants on the fake host, each with
//! a GPU slice of a SIMULATED host (tenantvm-gpu's sim backend behind the real planner)
//! and disk counters from its fake VMM. The admin sees both tenants' series; each tenant's
//! token sees its own only, and another tenant's token none of them.

use std::sync::Arc;

use axum::body::Body;
use axum::http::{Request, StatusCode};
use serde_json::json;
use tenantvm_gpu::backend::{self as gpu_backend, BackendSpec};
use tower::ServiceExt;

use super::router;
use crate::backend::DiskCounters;
use crate::gpu::BackendPlanner;
use crate::tenant::fault::FaultHook;
use crate::tenant::test_utils::Harness;

/// One H100 with MIG on, nothing on it yet (SIMULATED).
const ONE_H100: &str = r#"{"gpus": [{"index": 0, "model": "h100-80gb",
    "pci_address": "0000:41:00.0", "mig_enabled": true, "instances": []}]}"#;

async fn call(
    h: &Harness,
    method: &str,
    uri: &str,
    token: &str,
    body: Option<String>,
) -> (StatusCode, Vec<u8>) {
    let req = Request::builder()
        .method(method)
        .uri(uri)
        .header("authorization", format!("Bearer {token}"))
        .header("content-type", "application/json")
        .body(body.map_or_else(Body::empty, Body::from))
        .unwrap();
    let resp = router(h.svc.clone()).oneshot(req).await.unwrap();
    let status = resp.status();
    let bytes = axum::body::to_bytes(resp.into_body(), 1 << 20)
        .await
        .unwrap();
    (status, bytes.to_vec())
}

async fn metrics(h: &Harness, token: &str) -> String {
    let (status, body) = call(h, "GET", "/v1/metrics", token, None).await;
    assert_eq!(status, StatusCode::OK);
    String::from_utf8(body).unwrap()
}

#[tokio::test(flavor = "multi_thread")]
async fn disk_and_gpu_series_reach_their_own_tenant_only() {
    let base = Harness::new(FaultHook::default());
    let host_file = base.dir.path().join("gpu-host.json");
    std::fs::write(&host_file, ONE_H100).unwrap();
    let backend = gpu_backend::open(&BackendSpec::Sim(host_file.clone())).unwrap();
    let h = base.with_planner(Arc::new(BackendPlanner::new(backend)));
    let admin = h.admin_token();
    let mut tokens = Vec::new();
    for name in ["alice", "bob"] {
        let spec = json!({"name": name, "vcpus": 1, "memory_mib": 64,
            "image": {"name": "hello"}, "gpu": {"profile": "1g.10gb"}});
        let (status, body) = call(&h, "POST", "/v1/tenants", &admin, Some(spec.to_string())).await;
        assert_eq!(
            status,
            StatusCode::ACCEPTED,
            "{}",
            String::from_utf8_lossy(&body)
        );
        let v: serde_json::Value = serde_json::from_slice(&body).unwrap();
        tokens.push(v["token"].as_str().unwrap().to_string());
    }
    let svc = h.svc.clone();
    tokio::task::spawn_blocking(move || svc.wait_idle())
        .await
        .unwrap();
    // alice's VMM reports its disks; bob's reports none. The simulated host says what
    // alice's instance uses.
    h.host.state().disk_counters.insert(
        "alice".into(),
        DiskCounters {
            read_bytes: 7340032,
            write_bytes: 4096,
            read_ops: 112,
            write_ops: 1,
            flush_ops: 3,
        },
    );
    let alice_slot = h
        .svc
        .store()
        .gpu_placement(h.svc.store().tenant("alice").unwrap().unwrap().id)
        .unwrap()
        .unwrap();
    let start: u64 = alice_slot.label.split_once('@').unwrap().1.parse().unwrap();
    let mut host: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&host_file).unwrap()).unwrap();
    let instances = host["gpus"][0]["instances"].as_array_mut().unwrap();
    assert_eq!(instances.len(), 2, "{host}");
    for i in instances {
        if i["start"].as_u64() == Some(start) {
            i["usage"] = json!({"memory_used_mib": 2048, "utilization_percent": 61});
        }
    }
    std::fs::write(&host_file, host.to_string()).unwrap();

    let all = metrics(&h, &admin).await;
    for line in [
        "tenantvm_vm_disk_bytes{tenant=\"alice\",op=\"read\"} 7340032",
        "tenantvm_vm_disk_operations{tenant=\"alice\",op=\"flush\"} 3",
        "tenantvm_gpu_memory_used_bytes{tenant=\"alice\",source=\"simulated\"} 2147483648",
        "tenantvm_gpu_utilization_percent{tenant=\"alice\",source=\"simulated\"} 61",
        "tenantvm_gpu_memory_used_bytes{tenant=\"bob\",source=\"simulated\"} 0",
    ] {
        assert!(all.contains(line), "{line}\n{all}");
    }
    // bob's VMM reports no disks: absent, not zero.
    assert!(
        !all.contains("tenantvm_vm_disk_bytes{tenant=\"bob\""),
        "{all}"
    );

    let alice = metrics(&h, &tokens[0]).await;
    assert!(
        alice.contains("tenantvm_vm_disk_bytes{tenant=\"alice\",op=\"write\"} 4096"),
        "{alice}"
    );
    assert!(
        alice.contains("tenantvm_gpu_memory_bytes{tenant=\"alice\",source=\"simulated\"}"),
        "{alice}"
    );
    assert!(!alice.contains("bob"), "{alice}");
    let bob = metrics(&h, &tokens[1]).await;
    assert!(
        bob.contains("tenantvm_gpu_utilization_percent{tenant=\"bob\",source=\"simulated\"} 0"),
        "{bob}"
    );
    assert!(
        !bob.contains("alice") && !bob.contains("7340032") && !bob.contains("2147483648"),
        "{bob}"
    );
}

/// Three tenants whose VMMs stop answering: the admin's scrape asks all three at once (each
/// waits out its own deadline side by side), so silent VMMs cost the admin one deadline,
/// not one each; the scrape still answers, without their disk series.
#[tokio::test(flavor = "multi_thread")]
async fn an_admin_scrape_asks_silent_vmms_side_by_side() {
    let h = Harness::new(FaultHook::default());
    let admin = h.admin_token();
    let names = ["alice", "bob", "carol"];
    for name in names {
        let spec = json!({"name": name, "vcpus": 1, "memory_mib": 64,
            "image": {"name": "hello"}});
        let (status, body) = call(&h, "POST", "/v1/tenants", &admin, Some(spec.to_string())).await;
        assert_eq!(
            status,
            StatusCode::ACCEPTED,
            "{}",
            String::from_utf8_lossy(&body)
        );
    }
    let svc = h.svc.clone();
    tokio::task::spawn_blocking(move || svc.wait_idle())
        .await
        .unwrap();
    {
        let mut state = h.host.state();
        let pids: Vec<i32> = state.processes.keys().copied().collect();
        assert_eq!(pids.len(), names.len(), "{:?}", state.processes);
        state.stalled.extend(pids);
    }
    let all = metrics(&h, &admin).await;
    let state = h.host.state();
    assert_eq!(
        state.disk_counters_most_waiting,
        names.len(),
        "the silent VMMs were asked one after another"
    );
    assert_eq!(state.disk_counters_waiting, 0);
    drop(state);
    for name in names {
        assert!(
            !all.contains(&format!("tenantvm_vm_disk_bytes{{tenant=\"{name}\"")),
            "a silent VMM's disk series must be absent\n{all}"
        );
    }
    h.host.state().stalled.clear();
}
