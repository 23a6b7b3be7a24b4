//! Tests of [`super`]: a fake sysfs tree in a temporary directory and fake `nvidia-smi`
//! scripts (shell scripts named `fake-nvidia-smi-*`, run by absolute path).

use std::os::unix::fs::PermissionsExt;
use std::path::Path;
use std::time::{Duration, Instant};

use super::*;

fn reaper() -> Reaper {
    Reaper::start().unwrap()
}

/// A fake PCI function directory under `<root>/bus/pci/devices/<addr>`.
fn fake_function(root: &Path, addr: &str, attrs: &[(&str, &str)], driver: Option<&str>) {
    let dir = root.join("bus/pci/devices").join(addr);
    std::fs::create_dir_all(&dir).unwrap();
    for (k, v) in attrs {
        std::fs::write(dir.join(k), v).unwrap();
    }
    if let Some(d) = driver {
        let target = root.join("bus/pci/drivers").join(d);
        std::fs::create_dir_all(&target).unwrap();
        std::os::unix::fs::symlink(&target, dir.join("driver")).unwrap();
    }
}

fn gpu_attrs() -> Vec<(&'static str, &'static str)> {
    vec![
        ("vendor", "0x10de\n"),
        ("device", "0x2330\n"),
        ("subsystem_vendor", "0x10de\n"),
        ("subsystem_device", "0x16c1\n"),
        ("class", "0x030200\n"),
    ]
}

/// A fake `nvidia-smi`: a shell script with `body`, executable.
fn fake_smi(dir: &Path, name: &str, body: &str) -> PathBuf {
    let path = dir.join(format!("fake-nvidia-smi-{name}"));
    std::fs::write(&path, format!("#!/bin/sh\n{body}\n")).unwrap();
    std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o755)).unwrap();
    path
}

fn probe(root: &Path, smi: Vec<PathBuf>, deadline: Duration) -> GpuProbe {
    GpuProbe {
        sys_root: root.to_path_buf(),
        nvidia_smi: smi,
        deadline,
        env: vec![("PATH".into(), "/usr/bin:/bin".into())],
    }
}

#[test]
fn pci_functions_are_read_sorted_and_bad_entries_skipped() {
    let tmp = tempfile::tempdir().unwrap();
    let root = tmp.path();
    fake_function(root, "0000:00:05.0", &gpu_attrs(), Some("nvidia"));
    fake_function(
        root,
        "0000:00:01.0",
        &[
            ("vendor", "0x1af4\n"),
            ("device", "0x1042\n"),
            ("class", "0x010000\n"),
        ],
        None,
    );
    // Garbage: a vendor that is not hex, an id wider than 16 bits, a class wider than 24,
    // a name that is no address, a huge attribute.
    fake_function(
        root,
        "0000:00:02.0",
        &[("vendor", "zz"), ("device", "1"), ("class", "0")],
        None,
    );
    fake_function(
        root,
        "0000:00:03.0",
        &[("vendor", "0x12345"), ("device", "0x1"), ("class", "0x0")],
        None,
    );
    fake_function(
        root,
        "0000:00:04.0",
        &[("vendor", "0x1"), ("device", "0x1"), ("class", "0x1000000")],
        None,
    );
    fake_function(root, "not-an-address", &gpu_attrs(), None);
    let huge = "0".repeat(1 << 20);
    fake_function(
        root,
        "0000:00:06.0",
        &[("vendor", &huge), ("device", "0x1"), ("class", "0x0")],
        None,
    );
    let (pci, truncated, unreadable) = pci_functions(root);
    assert!(!truncated);
    assert_eq!(unreadable, 5);
    let addrs: Vec<&str> = pci.iter().map(|f| f.address.as_str()).collect();
    assert_eq!(addrs, ["0000:00:01.0", "0000:00:05.0"]);
    let gpu = &pci[1];
    assert_eq!(
        (gpu.vendor, gpu.device, gpu.class),
        (0x10de, 0x2330, 0x030200)
    );
    assert_eq!(
        (gpu.subsystem_vendor, gpu.subsystem_device),
        (Some(0x10de), Some(0x16c1))
    );
    assert_eq!(gpu.driver.as_deref(), Some("nvidia"));
    assert_eq!(pci[0].driver, None);
    assert_eq!(pci[0].subsystem_vendor, None);
}

#[test]
fn pci_functions_are_capped_and_a_missing_tree_is_empty() {
    let tmp = tempfile::tempdir().unwrap();
    for i in 0..(MAX_PCI_DEVICES + 3) {
        let addr = format!("0000:{:02x}:{:02x}.0", i / 32, i % 32);
        fake_function(tmp.path(), &addr, &gpu_attrs(), None);
    }
    let (pci, truncated, unreadable) = pci_functions(tmp.path());
    assert_eq!(
        (pci.len(), truncated, unreadable),
        (MAX_PCI_DEVICES, true, 0)
    );
    let empty = tempfile::tempdir().unwrap();
    assert_eq!(pci_functions(empty.path()), (Vec::new(), false, 0));
}

#[test]
fn nvidia_smi_csv_is_parsed_into_rows() {
    let text = "0, NVIDIA H100 80GB HBM3, GPU-1111, 81559, 0, Disabled\n\
                1, NVIDIA H100 80GB HBM3 MIG 1g.10gb, MIG-2222, 9984, 13, [N/A]\n\
                \n\
                2, NVIDIA L40S, GPU-3333, [N/A], [Not Supported], [N/A]\n";
    let (gpus, unparsed) = parse_smi_csv(text);
    assert_eq!(unparsed, 0);
    assert_eq!(gpus.len(), 3);
    assert_eq!(gpus[0].memory_total_mib, Some(81559));
    assert_eq!(gpus[0].mig_mode.as_deref(), Some("Disabled"));
    assert_eq!(gpus[1].uuid, "MIG-2222");
    assert_eq!(gpus[1].mig_mode, None);
    assert_eq!(
        (gpus[2].memory_total_mib, gpus[2].memory_used_mib),
        (None, None)
    );
}

#[test]
fn nvidia_smi_garbage_is_counted_not_trusted() {
    let mut text = String::from(
        "NVIDIA-SMI has failed because it couldn't communicate with the NVIDIA driver.\n\
         x, a, b, 1, 2, Enabled\n\
         0, name, uuid, -5, 0, Enabled\n\
         0, name, uuid, 99999999999999999999999, 0, Enabled\n\
         0, name, uuid, 1, 2, Enabled, extra\n\
         0, , uuid, 1, 2, Enabled\n",
    );
    text.push_str(&format!("0, {}, uuid, 1, 2, Enabled\n", "n".repeat(10_000)));
    for i in 0..(MAX_GPU_ROWS + 2) {
        text.push_str(&format!("{i}, GPU\x1b[31m, uuid-{i}, 1024, 0, Disabled\n"));
    }
    let (gpus, unparsed) = parse_smi_csv(&text);
    assert_eq!(gpus.len(), MAX_GPU_ROWS);
    assert_eq!(unparsed, 7 + 2);
    assert!(gpus.iter().all(|g| is_plain_field(&g.name)), "{gpus:?}");
}

#[test]
fn absent_nvidia_smi_is_said_plainly() {
    let tmp = tempfile::tempdir().unwrap();
    // A directory and a non-executable file are not nvidia-smi.
    std::fs::create_dir(tmp.path().join("dir")).unwrap();
    std::fs::write(tmp.path().join("plain"), "x").unwrap();
    let candidates = vec![
        tmp.path().join("missing"),
        tmp.path().join("dir"),
        tmp.path().join("plain"),
    ];
    let p = probe(tmp.path(), candidates, Duration::from_secs(5));
    let reply = p.report(&reaper());
    assert!(reply.pci.is_empty());
    match reply.nvidia_smi {
        NvidiaSmi::Absent { searched } => assert_eq!(searched.len(), 3),
        other => panic!("{other:?}"),
    }
}

#[test]
fn fake_nvidia_smi_runs_with_the_fixed_query_and_its_rows_come_back() {
    let tmp = tempfile::tempdir().unwrap();
    fake_function(tmp.path(), "0000:00:05.0", &gpu_attrs(), Some("nvidia"));
    let args_file = tmp.path().join("args");
    let smi = fake_smi(
        tmp.path(),
        "ok",
        &format!(
            "echo \"$@\" > {}\necho '0, NVIDIA H100 80GB HBM3 MIG 1g.10gb, MIG-abc, 9984, 0, [N/A]'",
            args_file.display()
        ),
    );
    let p = probe(
        tmp.path(),
        vec![tmp.path().join("missing"), smi.clone()],
        Duration::from_secs(10),
    );
    let reply = p.report(&reaper());
    assert_eq!(reply.check(), Ok(()));
    assert_eq!(reply.pci.len(), 1);
    let NvidiaSmi::Ran {
        path,
        gpus,
        unparsed_lines,
        truncated,
    } = reply.nvidia_smi
    else {
        panic!("{:?}", reply.nvidia_smi)
    };
    assert_eq!(path, smi.display().to_string());
    assert_eq!((gpus.len(), unparsed_lines, truncated), (1, 0, false));
    assert_eq!(gpus[0].memory_total_mib, Some(9984));
    assert_eq!(
        std::fs::read_to_string(args_file).unwrap().trim(),
        format!("--query-gpu={NVIDIA_SMI_QUERY} --format=csv,noheader,nounits")
    );
}

#[test]
fn fake_nvidia_smi_that_hangs_is_killed_at_the_deadline() {
    let tmp = tempfile::tempdir().unwrap();
    // It and a child of its own hold the output pipe; both go at the deadline.
    let smi = fake_smi(tmp.path(), "hang", "sleep 600 &\nsleep 600");
    let p = probe(tmp.path(), vec![smi], Duration::from_millis(500));
    let started = Instant::now();
    let out = p.nvidia_smi(&reaper());
    assert!(
        started.elapsed() < Duration::from_secs(10),
        "{:?}",
        started.elapsed()
    );
    assert!(
        matches!(out, NvidiaSmi::TimedOut { after_ms: 500, .. }),
        "{out:?}"
    );
}

#[test]
fn fake_nvidia_smi_printing_garbage_or_too_much_or_failing_is_bounded() {
    let tmp = tempfile::tempdir().unwrap();
    let garbage = fake_smi(
        tmp.path(),
        "garbage",
        "printf 'Segmentation fault\\n\\377\\376\\033[2J\\n0, GPU, uuid, lots, 0, Enabled\\n'",
    );
    let out = probe(tmp.path(), vec![garbage], Duration::from_secs(10)).nvidia_smi(&reaper());
    assert!(
        matches!(
            out,
            NvidiaSmi::Ran {
                ref gpus,
                unparsed_lines: 3,
                truncated: false,
                ..
            } if gpus.is_empty()
        ),
        "{out:?}"
    );
    let flood = fake_smi(
        tmp.path(),
        "flood",
        "yes '0, NVIDIA L40S, GPU-1, 46068, 0, [N/A]' | head -c 10000000",
    );
    let out = probe(tmp.path(), vec![flood], Duration::from_secs(20)).nvidia_smi(&reaper());
    let NvidiaSmi::Ran {
        gpus, truncated, ..
    } = out
    else {
        panic!("{out:?}")
    };
    assert!(truncated);
    assert_eq!(gpus.len(), MAX_GPU_ROWS);
    let failing = fake_smi(
        tmp.path(),
        "fails",
        "echo \"NVIDIA-SMI has failed because it couldn't communicate with the NVIDIA driver\" >&2\nexit 9",
    );
    let out = probe(tmp.path(), vec![failing], Duration::from_secs(10)).nvidia_smi(&reaper());
    let NvidiaSmi::Failed {
        exit_code, message, ..
    } = out
    else {
        panic!("{out:?}")
    };
    assert_eq!(exit_code, Some(9));
    assert!(message.contains("couldn't communicate"), "{message}");
}
