//! Tests of [`super::compare`]: each rule, with a whole card, a MIG vGPU, a simulated host
//! and no share.

use tenantvm_agent_protocol::{PciFunction, SmiGpu};

use super::*;

fn whole() -> AssignedGpu {
    AssignedGpu {
        gpu: "0000:18:00.0".into(),
        label: "whole".into(),
        route: "whole-gpu".into(),
        model: Some("NVIDIA L40S".into()),
        mig_profile: None,
        memory_mib: Some(46_068),
        host_devices: vec!["0000:18:00.0".into()],
        vendor: Some(0x10de),
        device: Some(0x26b9),
        not_attached: None,
    }
}

fn vgpu() -> AssignedGpu {
    AssignedGpu {
        label: "1g.10gb@3".into(),
        route: "sriov-vgpu".into(),
        mig_profile: Some("1g.10gb".into()),
        memory_mib: Some(9_984),
        device: None,
        ..whole()
    }
}

fn function(vendor: u16, device: u16, class: u32) -> PciFunction {
    PciFunction {
        address: "0000:00:05.0".into(),
        vendor,
        device,
        subsystem_vendor: None,
        subsystem_device: None,
        class,
        driver: None,
    }
}

fn smi(memory: &[Option<u64>]) -> NvidiaSmi {
    NvidiaSmi::Ran {
        path: "/usr/bin/nvidia-smi".into(),
        gpus: memory
            .iter()
            .enumerate()
            .map(|(i, m)| SmiGpu {
                index: i as u32,
                name: "GPU".into(),
                uuid: format!("GPU-{i}"),
                memory_total_mib: *m,
                memory_used_mib: Some(0),
                mig_mode: None,
            })
            .collect(),
        unparsed_lines: 0,
        truncated: false,
    }
}

fn guest(pci: Vec<PciFunction>, nvidia_smi: NvidiaSmi) -> GpuInfoReply {
    GpuInfoReply {
        pci,
        pci_truncated: false,
        pci_unreadable: 0,
        nvidia_smi,
    }
}

fn mismatches(f: &[Finding]) -> Vec<&str> {
    f.iter()
        .filter(|f| f.level == FindingLevel::Mismatch)
        .map(|f| f.message.as_str())
        .collect()
}

#[test]
fn the_tolerance_holds_5_percent_either_way() {
    assert!(memory_matches(46_068, 46_068));
    assert!(memory_matches(9_984 * 95 / 100 + 1, 9_984));
    assert!(memory_matches(9_984 * 105 / 100, 9_984));
    assert!(!memory_matches(9_984 * 94 / 100, 9_984));
    assert!(!memory_matches(19_968, 9_984));
    assert!(!memory_matches(4_864, 9_984));
    assert!(!memory_matches(u64::MAX, 9_984));
}

#[test]
fn a_whole_card_seen_with_its_memory_matches() {
    let g = guest(
        vec![function(0x10de, 0x26b9, 0x030200)],
        smi(&[Some(46_000)]),
    );
    assert_eq!(mismatches(&compare(Some(&whole()), &g)), Vec::<&str>::new());
    let v = guest(
        vec![function(0x10de, 0x2330, 0x030200)],
        smi(&[Some(9_728)]),
    );
    assert_eq!(mismatches(&compare(Some(&vgpu()), &v)), Vec::<&str>::new());
}

#[test]
fn missing_devices_wrong_counts_and_wrong_memory_are_mismatches() {
    // No function with the card's ids.
    let g = guest(
        vec![function(0x1af4, 0x1042, 0x010000)],
        smi(&[Some(46_068)]),
    );
    let m = compare(Some(&whole()), &g);
    assert!(
        mismatches(&m)[0].contains("no PCI function 10de:26b9"),
        "{m:?}"
    );
    // A vGPU needs an NVIDIA display-class function.
    let g = guest(
        vec![function(0x10de, 0x1aef, 0x040300)],
        smi(&[Some(9_984)]),
    );
    assert_eq!(mismatches(&compare(Some(&vgpu()), &g)).len(), 1);
    // Two GPUs for one slice; none at all.
    let pci = vec![function(0x10de, 0x26b9, 0x030200)];
    for rows in [vec![Some(46_068), Some(46_068)], vec![]] {
        let m = compare(Some(&whole()), &guest(pci.clone(), smi(&rows)));
        assert!(
            mismatches(&m)[0].contains("GPUs; the tenant was given one"),
            "{m:?}"
        );
    }
    // A 2g slice's memory where a 1g was assigned; no memory figure.
    let m = compare(Some(&vgpu()), &guest(pci.clone(), smi(&[Some(19_968)])));
    assert!(
        mismatches(&m)[0].contains("19968 MiB; the slice has 9984 MiB"),
        "{m:?}"
    );
    let m = compare(Some(&vgpu()), &guest(pci.clone(), smi(&[None])));
    assert_eq!(mismatches(&m).len(), 1);
    // nvidia-smi failing or hanging where a GPU was handed over.
    for s in [
        NvidiaSmi::Failed {
            path: "/usr/bin/nvidia-smi".into(),
            exit_code: Some(9),
            message: "couldn't communicate with the NVIDIA driver".into(),
        },
        NvidiaSmi::TimedOut {
            path: "/usr/bin/nvidia-smi".into(),
            after_ms: 20_000,
        },
    ] {
        assert_eq!(
            mismatches(&compare(Some(&whole()), &guest(pci.clone(), s))).len(),
            1
        );
    }
}

#[test]
fn a_gpu_the_tenant_was_not_given_is_a_mismatch() {
    let g = guest(
        vec![function(0x10de, 0x26b9, 0x030200)],
        smi(&[Some(46_068)]),
    );
    let m = compare(None, &g);
    assert!(mismatches(&m)[0].contains("no GPU share"), "{m:?}");
    let sim = AssignedGpu {
        not_attached: Some("SIMULATED GPU host: no device is handed to the VM".into()),
        route: "not-attached".into(),
        ..whole()
    };
    let m = compare(Some(&sim), &g);
    assert!(mismatches(&m)[0].contains("no device was handed"), "{m:?}");
}

#[test]
fn a_simulated_host_and_an_image_without_nvidia_smi_are_notes() {
    let sim = AssignedGpu {
        not_attached: Some("SIMULATED GPU host: no device is handed to the VM".into()),
        route: "not-attached".into(),
        host_devices: vec![],
        ..whole()
    };
    let absent = NvidiaSmi::Absent {
        searched: vec!["/usr/bin/nvidia-smi".into()],
    };
    let m = compare(Some(&sim), &guest(vec![], absent.clone()));
    assert!(mismatches(&m).is_empty(), "{m:?}");
    assert!(m[0].message.contains("SIMULATED"), "{m:?}");
    // The edu device posing as a whole card: its ids are in the guest; no nvidia-smi.
    let edu = AssignedGpu {
        vendor: Some(0x1234),
        device: Some(0x11e8),
        ..whole()
    };
    let m = compare(
        Some(&edu),
        &guest(vec![function(0x1234, 0x11e8, 0x00ff00)], absent.clone()),
    );
    assert!(mismatches(&m).is_empty(), "{m:?}");
    assert!(m.iter().any(|f| f.message.contains("no nvidia-smi")));
    let m = compare(None, &guest(vec![], absent));
    assert!(mismatches(&m).is_empty(), "{m:?}");
}
