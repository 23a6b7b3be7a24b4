//! The bench-vfio-hugepages scenario's program (a benchmark, not a test): what huge pages
//! change for a tenant with a device, through a real tenantvmd.
//!
//! ```text
//! nh-vfio-hugepages DEVICE [MIB...]      guest sizes in MiB (default 2048)
//! ```
//! DEVICE: QEMU's plain nvme (1b36:0010) on no driver, given whole (a SIMULATED whole-only
//! GPU at its address, `--gpu-sysfs-root /`). env: NH_BIN, NH_TEST_GUESTS, NH_WORK,
//! NH_NOTES. Runs as root with cgroup v2 mounted and vfio-pci loaded.
//!
//! For each size and each page size (`hugepages = "off"`: 4 KiB; `"2M"`; `"1G"`), on a
//! fresh daemon: the pool of that page size is reserved for the guest's RAM at run time
//! (`nr_hugepages`; a pool the outer guest cannot fill is a NOTE saying how many pages it
//! got, and that cell is left out), the tenant (the test guest, `tvm.test=vfio-nvme-hold`,
//! the device whole) is created and timed to `running`, the guest must report the device,
//! then the tenant is stopped, its VMM's exit report gives the DMA-map time (all guest RAM
//! pinned and mapped through the IOMMU: `dma_map_ms`), and it is destroyed and the pool
//! emptied. NOTE lines: each cell, and per size the 2M and 1G figures against 4 KiB's.

use std::path::Path;
use std::process::ExitCode;
use std::time::Duration;
use tenantvm_nested_host::gpu_tenant::{
    destroy, guest_report, test_guest_image, timed_create, Setup,
};
use tenantvm_nested_host::scenario::{env_path, note};

/// The tenant's name.
const NAME: &str = "nh-huge";
/// The test the guest runs.
const GUEST_TEST: &str = "vfio-nvme-hold";
/// How long the guest may take to report after the tenant is running.
const GUEST_REPORT_TIMEOUT: Duration = Duration::from_secs(120);

/// One page size: the spec's word, the pool's sysfs name, the page in MiB.
const PAGES: [(&str, Option<(&str, u64)>); 3] = [
    ("off", None),
    ("2M", Some(("hugepages-2048kB", 2))),
    ("1G", Some(("hugepages-1048576kB", 1024))),
];

fn pool(name: &str, file: &str) -> std::path::PathBuf {
    Path::new("/sys/kernel/mm/hugepages").join(name).join(file)
}

/// Sets the pool `name` to `pages` pages; returns how many it holds then.
fn reserve(name: &str, pages: u64) -> Result<u64, String> {
    let path = pool(name, "nr_hugepages");
    std::fs::write(&path, pages.to_string()).map_err(|e| format!("{}: {e}", path.display()))?;
    std::fs::read_to_string(&path)
        .map_err(|e| e.to_string())?
        .trim()
        .parse()
        .map_err(|e| format!("{}: {e}", path.display()))
}

fn empty_pools() {
    for (_, p) in PAGES {
        if let Some((name, _)) = p {
            let _ = reserve(name, 0);
        }
    }
}

/// One cell: (create to running in s, DMA map in ms), or None when its pool could not be
/// reserved (a NOTE says so).
fn cell(
    setup: &Setup,
    mib: u64,
    word: &str,
    page: Option<(&str, u64)>,
) -> Result<Option<(f64, u64)>, String> {
    empty_pools();
    if let Some((name, page_mib)) = page {
        let want = mib.div_ceil(page_mib);
        let got = reserve(name, want)?;
        if got < want {
            note(&format!(
                "{mib} MiB guest on {word} pages: the outer guest reserved only {got} of {want} pages; left out"
            ));
            empty_pools();
            return Ok(None);
        }
    }
    let spec = setup.work.join(format!("huge-{mib}-{word}.toml"));
    std::fs::write(
        &spec,
        format!(
            "name = \"{NAME}\"\nvcpus = 1\nmemory_mib = {mib}\nhugepages = \"{word}\"\n\
             gpu = {{ whole_gpu = true }}\n[image]\nname = \"nvme-guest\"\n"
        ),
    )
    .map_err(|e| e.to_string())?;
    let state = setup.work.join(format!("state-{mib}-{word}"));
    let log = format!("daemon-{mib}-{word}.log");
    let (d, cli, secs) = timed_create(setup, &state, &log, &spec, NAME)?;
    guest_report(
        &cli,
        &d,
        NAME,
        GUEST_TEST,
        &["pci=1b36:0010"],
        GUEST_REPORT_TIMEOUT,
    )?;
    let timeout = tenantvm_nested_host::gpu_tenant::LIFECYCLE_TIMEOUT_S.to_string();
    cli.ok(&["stop", NAME, "--timeout-s", &timeout], &d)?;
    let report = state.join("tenants").join(NAME).join("report/exit.json");
    let text =
        std::fs::read_to_string(&report).map_err(|e| format!("{}: {e}", report.display()))?;
    let v: serde_json::Value = serde_json::from_str(&text).map_err(|e| e.to_string())?;
    let ms = v["devices"][0]["dma_map_ms"]
        .as_u64()
        .ok_or_else(|| format!("the exit report has no dma_map_ms: {text}"))?;
    destroy(&cli, &d, NAME)?;
    drop(d);
    empty_pools();
    note(&format!(
        "{mib} MiB guest on {word} pages (device whole): DMA map {ms} ms, create to running {secs:.2} s"
    ));
    Ok(Some((secs, ms)))
}

fn run() -> Result<(), String> {
    let mut args = std::env::args().skip(1);
    let device = args
        .next()
        .ok_or("usage: nh-vfio-hugepages DEVICE [MIB...]")?;
    let sizes: Vec<u64> = args
        .map(|a| a.parse().map_err(|_| format!("{a} is not a size in MiB")))
        .collect::<Result<_, _>>()?;
    let sizes = if sizes.is_empty() { vec![2048] } else { sizes };
    let work = env_path("NH_WORK")?;
    let sim = work.join("sim-host.json");
    let group: Option<u32> =
        std::fs::read_link(format!("/sys/bus/pci/devices/{device}/iommu_group"))
            .ok()
            .and_then(|t| t.file_name()?.to_str()?.parse().ok());
    let host = serde_json::json!({
        "comment": "SIMULATED: a whole-only GPU at the address of QEMU's plain nvme",
        "gpus": [{"index": 0, "model": "l40s", "pci_address": device, "driver": "570.124.06",
                  "vgpu": "none", "iommu_group": group}]
    });
    std::fs::write(&sim, host.to_string()).map_err(|e| e.to_string())?;
    let images = work.join("img");
    test_guest_image(&images, "nvme-guest", GUEST_TEST)?;
    let setup = Setup {
        bin: env_path("NH_BIN")?,
        work,
        sim,
        images,
    };
    for mib in sizes {
        let mut base = None;
        for (word, page) in PAGES {
            let Some((secs, ms)) = cell(&setup, mib, word, page)? else {
                continue;
            };
            match base {
                None if word == "off" => base = Some((secs, ms)),
                Some((bs, bms)) => note(&format!(
                    "{mib} MiB guest, {word} against 4 KiB pages: DMA map {:.2}x ({ms} / {bms} ms), create to running {:.2}x ({secs:.2} / {bs:.2} s)",
                    ms as f64 / (bms as f64).max(1.0),
                    secs / bs
                )),
                None => {}
            }
        }
    }
    Ok(())
}

fn main() -> ExitCode {
    let result = run();
    empty_pools();
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("nh-vfio-hugepages: FAILED: {e}");
            ExitCode::FAILURE
        }
    }
}
