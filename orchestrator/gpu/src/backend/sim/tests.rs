//! Tests of the simulated backend.

use super::*;

fn host_file(dir: &Path, body: &str) -> PathBuf {
    let p = dir.join("host.json");
    std::fs::write(&p, body).unwrap();
    p
}

const TWO_H100: &str = r#"{"gpus": [
    {"index": 0, "model": "h100-80gb", "pci_address": "0000:18:00.0", "mig_enabled": true,
     "instances": [{"gi_id": 1, "profile": "3g.40gb", "start": 0, "in_use": true}]},
    {"index": 1, "model": "h100-80gb", "pci_address": "0000:2a:00.0"}]}"#;

#[test]
fn overlap_is_insufficient_resources_and_bad_start_is_invalid() {
    let dir = tempfile::tempdir().unwrap();
    let b = SimBackend::open(&host_file(dir.path(), TWO_H100)).unwrap();
    let e = b.create_instance(0, 14, 2).unwrap_err();
    assert!(
        matches!(e, BackendError::InsufficientResources { gpu: 0, .. }),
        "{e}"
    );
    let e = b.create_instance(0, 14, 5).unwrap_err();
    assert!(matches!(e, BackendError::InvalidPlacement { .. }), "{e}");
    let gi = b.create_instance(0, 14, 4).unwrap();
    assert_eq!((gi.gi_id, gi.start, gi.size), (2, 4, 2));
    assert_eq!(
        b.remaining_capacity(0, 19).unwrap(),
        1,
        "only slot 6 is a free 1g start"
    );
}

#[test]
fn destroy_in_use_is_refused_and_changes_persist_across_opens() {
    let dir = tempfile::tempdir().unwrap();
    let path = host_file(dir.path(), TWO_H100);
    let b = SimBackend::open(&path).unwrap();
    let e = b.destroy_instance(0, 1).unwrap_err();
    assert!(matches!(e, BackendError::InUse { .. }), "{e}");
    b.set_in_use(0, 1, false).unwrap();
    b.destroy_instance(0, 1).unwrap();
    assert!(matches!(
        b.destroy_instance(0, 1),
        Err(BackendError::NoSuchInstance { .. })
    ));
    let again = SimBackend::open(&path).unwrap();
    assert!(again.gpus().unwrap()[0].instances.is_empty());
}

#[test]
fn mig_mode_rules_follow_the_hardware() {
    let dir = tempfile::tempdir().unwrap();
    let b = SimBackend::open(&host_file(dir.path(), TWO_H100)).unwrap();
    assert!(matches!(
        b.create_instance(1, 19, 0),
        Err(BackendError::MigDisabled(1))
    ));
    assert!(matches!(
        b.set_mig_mode(0, false),
        Err(BackendError::InUse { .. })
    ));
    b.set_mig_mode(1, true).unwrap();
    b.create_instance(1, 0, 0).unwrap();
    assert_eq!(b.possible_placements(1, 9).unwrap(), vec![(0, 4), (4, 4)]);
    assert!(matches!(
        b.possible_placements(1, 77),
        Err(BackendError::UnknownProfile { .. })
    ));
    assert_eq!(b.gpus().unwrap().len(), 2);
    assert!(matches!(
        b.create_instance(7, 0, 0),
        Err(BackendError::NoSuchGpu(7))
    ));
}

#[test]
fn invalid_files_are_refused_with_the_reason() {
    let dir = tempfile::tempdir().unwrap();
    for (body, want) in [
        ("{", "not a simulated host"),
        (
            r#"{"gpus":[{"index":0,"model":"h999","pci_address":"x"}]}"#,
            "Unknown GPU model",
        ),
        (
            r#"{"gpus":[{"index":0,"model":"h100-80gb","pci_address":"x","mig_enabled":true,
              "instances":[{"gi_id":1,"profile":"4g.40gb","start":0},{"gi_id":2,"profile":"1g.10gb","start":3}]}]}"#,
            "overlap",
        ),
        (
            r#"{"gpus":[{"index":0,"model":"h100-80gb","pci_address":"x"},{"index":0,"model":"h100-80gb","pci_address":"y"}]}"#,
            "twice",
        ),
    ] {
        let e = SimBackend::open(&host_file(dir.path(), body)).unwrap_err();
        assert!(e.to_string().contains(want), "{e}");
    }
    let e = SimBackend::open(&dir.path().join("missing.json")).unwrap_err();
    assert!(e.to_string().contains("cannot read"), "{e}");
}

#[test]
fn usage_is_what_the_file_says_labelled_simulated() {
    let dir = tempfile::tempdir().unwrap();
    let path = host_file(
        dir.path(),
        r#"{"gpus": [
    {"index": 0, "model": "h100-80gb", "pci_address": "0000:18:00.0", "mig_enabled": true,
     "instances": [{"gi_id": 1, "profile": "3g.40gb", "start": 0,
                    "usage": {"memory_used_mib": 1024, "utilization_percent": 37}},
                   {"gi_id": 2, "profile": "1g.10gb", "start": 6}]},
    {"index": 1, "model": "h100-80gb", "pci_address": "0000:2a:00.0",
     "usage": {"memory_used_mib": 999999, "utilization_percent": 5}}]}"#,
    );
    let b = SimBackend::open(&path).unwrap();
    let u = b.usage(0, Some(1)).unwrap().unwrap();
    assert_eq!(u.memory_used_bytes, 1024 << 20);
    let h100 = crate::mig::model_by_key("h100-80gb").unwrap();
    assert_eq!(
        u.memory_total_bytes,
        h100.profile("3g.40gb").unwrap().memory_mib << 20
    );
    assert_eq!(u.utilization_percent, Some(37));
    assert_eq!(u.source, UsageSource::Simulated);
    // An instance the file says nothing about uses nothing.
    let idle = b.usage(0, Some(2)).unwrap().unwrap();
    assert_eq!(
        (idle.memory_used_bytes, idle.utilization_percent),
        (0, Some(0))
    );
    // A whole GPU: never more than its memory.
    let whole = b.usage(1, None).unwrap().unwrap();
    assert_eq!(whole.memory_used_bytes, whole.memory_total_bytes);
    assert_eq!(whole.utilization_percent, Some(5));
    // No such instance, no such GPU.
    assert!(matches!(
        b.usage(0, Some(9)),
        Err(BackendError::NoSuchInstance { gpu: 0, gi: 9 })
    ));
    b.usage(7, None).unwrap_err();
}

#[test]
fn a_usage_over_100_percent_is_refused_when_the_file_is_read() {
    let dir = tempfile::tempdir().unwrap();
    let path = host_file(
        dir.path(),
        r#"{"gpus": [{"index": 0, "model": "h100-80gb", "pci_address": "0000:18:00.0",
     "usage": {"utilization_percent": 101}}]}"#,
    );
    let e = SimBackend::open(&path)
        .and_then(|b| b.gpus())
        .unwrap_err()
        .to_string();
    assert!(e.contains("utilization_percent 101 is over 100"), "{e}");
}
