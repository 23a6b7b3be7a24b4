//! `gpu-info`: the guest's own view of its devices. [`GpuProbe`] reads the PCI functions
//! under `<root>/bus/pci/devices` (bounded, each attribute read capped and parsed
//! defensively: an entry that does not parse is counted and skipped) and runs the image's
//! `nvidia-smi`, when there is one, with a fixed query, no shell, a deadline (killed with
//! its process group on expiry) and capped output.

use std::io::Read;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::mpsc;
use std::time::Duration;

use nix::sys::signal::{killpg, Signal};
use nix::unistd::Pid;
use tenantvm_agent_protocol::gpu::{is_plain_field, MAX_FIELD_LEN, MAX_NVIDIA_SMI_OUTPUT};
use tenantvm_agent_protocol::{
    GpuInfoReply, NvidiaSmi, PciFunction, SmiGpu, MAX_GPU_ROWS, MAX_PCI_DEVICES,
    NVIDIA_SMI_DEADLINE_SECS, NVIDIA_SMI_QUERY,
};

use crate::reaper::Reaper;

/// Where an image keeps `nvidia-smi`: the root file system's usual places, then the
/// payload's root (`/payload`, where an image variant's packages land).
pub const NVIDIA_SMI_PATHS: &[&str] = &[
    "/usr/bin/nvidia-smi",
    "/usr/sbin/nvidia-smi",
    "/bin/nvidia-smi",
    "/sbin/nvidia-smi",
    "/usr/local/bin/nvidia-smi",
    "/payload/usr/bin/nvidia-smi",
    "/payload/bin/nvidia-smi",
];
/// Largest sysfs attribute read (`0x10de\n` is 7 bytes).
const MAX_ATTR_LEN: u64 = 64;
/// Most directory entries looked at under `bus/pci/devices` (listed or not).
const MAX_ENTRIES_SCANNED: usize = 4 * MAX_PCI_DEVICES;
/// How long the agent waits for a killed `nvidia-smi` to be reaped.
const KILL_GRACE: Duration = Duration::from_secs(5);

/// Reads the guest's devices. [`GpuProbe::guest`] is the real one; tests point the root
/// and the `nvidia-smi` candidates into a temporary directory.
#[derive(Debug, Clone)]
pub struct GpuProbe {
    /// The sysfs mount (`/sys`).
    pub sys_root: PathBuf,
    /// Where to look for `nvidia-smi`, in order; the first regular executable file runs.
    pub nvidia_smi: Vec<PathBuf>,
    /// How long `nvidia-smi` may run.
    pub deadline: Duration,
    /// Its environment (nothing else is inherited): a PATH and, where the payload sets
    /// one, its `LD_LIBRARY_PATH` (so a binary from the payload finds its libraries).
    pub env: Vec<(String, String)>,
}

impl GpuProbe {
    /// The probe of the running guest: `/sys`, [`NVIDIA_SMI_PATHS`], the protocol's
    /// deadline, and the payload's `LD_LIBRARY_PATH` if its config sets one.
    pub fn guest(payload_env: &std::collections::BTreeMap<String, String>) -> Self {
        let mut env = vec![(
            "PATH".to_string(),
            "/usr/bin:/bin:/usr/sbin:/sbin:/payload/usr/bin:/payload/bin".to_string(),
        )];
        if let Some(v) = payload_env.get("LD_LIBRARY_PATH") {
            env.push(("LD_LIBRARY_PATH".into(), v.clone()));
        }
        Self {
            sys_root: PathBuf::from("/sys"),
            nvidia_smi: NVIDIA_SMI_PATHS.iter().map(PathBuf::from).collect(),
            deadline: Duration::from_secs(NVIDIA_SMI_DEADLINE_SECS),
            env,
        }
    }

    /// The whole answer: PCI functions, then `nvidia-smi`.
    pub fn report(&self, reaper: &Reaper) -> GpuInfoReply {
        let (pci, pci_truncated, pci_unreadable) = pci_functions(&self.sys_root);
        GpuInfoReply {
            pci,
            pci_truncated,
            pci_unreadable,
            nvidia_smi: self.nvidia_smi(reaper),
        }
    }

    /// Finds and runs `nvidia-smi`.
    pub fn nvidia_smi(&self, reaper: &Reaper) -> NvidiaSmi {
        match self.nvidia_smi.iter().find(|p| is_executable(p)) {
            Some(path) => run_nvidia_smi(reaper, path, &self.env, self.deadline),
            None => NvidiaSmi::Absent {
                searched: self
                    .nvidia_smi
                    .iter()
                    .take(MAX_GPU_ROWS)
                    .map(|p| clip(&p.display().to_string()))
                    .collect(),
            },
        }
    }
}

fn is_executable(p: &Path) -> bool {
    use std::os::unix::fs::PermissionsExt;
    std::fs::metadata(p).is_ok_and(|m| m.is_file() && m.permissions().mode() & 0o111 != 0)
}

/// `s` on one line, without control characters, at most [`MAX_FIELD_LEN`] bytes (cut on a
/// character boundary).
pub fn clip(s: &str) -> String {
    let mut out = String::new();
    for c in s.chars().map(|c| if c.is_control() { ' ' } else { c }) {
        if out.len() + c.len_utf8() > MAX_FIELD_LEN {
            break;
        }
        out.push(c);
    }
    debug_assert!(is_plain_field(&out));
    out
}

fn read_attr(dir: &Path, name: &str) -> Option<String> {
    let mut buf = String::new();
    std::fs::File::open(dir.join(name))
        .ok()?
        .take(MAX_ATTR_LEN)
        .read_to_string(&mut buf)
        .ok()?;
    Some(buf.trim().to_string())
}

fn hex_attr(dir: &Path, name: &str) -> Option<u32> {
    let text = read_attr(dir, name)?;
    let digits = text.strip_prefix("0x").unwrap_or(&text);
    if digits.is_empty() || digits.len() > 8 {
        return None;
    }
    u32::from_str_radix(digits, 16).ok()
}

fn id_attr(dir: &Path, name: &str) -> Option<u16> {
    hex_attr(dir, name).and_then(|v| u16::try_from(v).ok())
}

/// One function from its sysfs directory; None when a required attribute does not parse.
fn pci_function(dir: &Path, address: &str) -> Option<PciFunction> {
    let class = hex_attr(dir, "class").filter(|c| *c <= 0x00ff_ffff)?;
    let driver = std::fs::read_link(dir.join("driver"))
        .ok()
        .and_then(|t| t.file_name().map(|n| clip(&n.to_string_lossy())));
    Some(PciFunction {
        address: address.to_string(),
        vendor: id_attr(dir, "vendor")?,
        device: id_attr(dir, "device")?,
        subsystem_vendor: id_attr(dir, "subsystem_vendor"),
        subsystem_device: id_attr(dir, "subsystem_device"),
        class,
        driver,
    })
}

/// The PCI functions under `<sys_root>/bus/pci/devices`, by address: at most
/// [`MAX_PCI_DEVICES`] (and whether more were cut), and how many entries were skipped as
/// unreadable. A missing directory is an empty list (a guest without PCI).
pub fn pci_functions(sys_root: &Path) -> (Vec<PciFunction>, bool, u32) {
    let Ok(entries) = std::fs::read_dir(sys_root.join("bus/pci/devices")) else {
        return (Vec::new(), false, 0);
    };
    let mut names = Vec::new();
    let mut unreadable = 0u32;
    let mut truncated = false;
    for (i, entry) in entries.enumerate() {
        if i >= MAX_ENTRIES_SCANNED {
            truncated = true;
            break;
        }
        match entry.ok().and_then(|e| e.file_name().into_string().ok()) {
            Some(n) if tenantvm_agent_protocol::gpu::is_pci_address(&n) => names.push(n),
            _ => unreadable = unreadable.saturating_add(1),
        }
    }
    names.sort();
    if names.len() > MAX_PCI_DEVICES {
        names.truncate(MAX_PCI_DEVICES);
        truncated = true;
    }
    let dir = sys_root.join("bus/pci/devices");
    let mut out = Vec::with_capacity(names.len());
    for n in names {
        match pci_function(&dir.join(&n), &n) {
            Some(f) => out.push(f),
            None => unreadable = unreadable.saturating_add(1),
        }
    }
    (out, truncated, unreadable)
}

/// A number field of `nvidia-smi`'s CSV: None for `[N/A]`, `N/A`, `[Not Supported]` and
/// the like; Err for anything else that is not a number.
fn smi_number(s: &str) -> Result<Option<u64>, ()> {
    if s.starts_with('[') || s.eq_ignore_ascii_case("n/a") {
        return Ok(None);
    }
    s.parse().map(Some).map_err(|_| ())
}

fn smi_row(line: &str) -> Option<SmiGpu> {
    let fields: Vec<&str> = line.split(',').map(str::trim).collect();
    let [index, name, uuid, total, used, mig] = fields.as_slice() else {
        return None;
    };
    if name.is_empty() || name.len() > MAX_FIELD_LEN || uuid.len() > MAX_FIELD_LEN {
        return None;
    }
    Some(SmiGpu {
        index: index.parse().ok()?,
        name: clip(name),
        uuid: clip(uuid),
        memory_total_mib: smi_number(total).ok()?,
        memory_used_mib: smi_number(used).ok()?,
        mig_mode: (!mig.starts_with('[') && !mig.eq_ignore_ascii_case("n/a")).then(|| clip(mig)),
    })
}

/// Parses `nvidia-smi --query-gpu=<NVIDIA_SMI_QUERY> --format=csv,noheader,nounits`:
/// the rows (at most [`MAX_GPU_ROWS`]) and how many non-empty lines were not rows.
pub fn parse_smi_csv(text: &str) -> (Vec<SmiGpu>, u32) {
    let mut gpus = Vec::new();
    let mut unparsed = 0u32;
    for line in text.lines().map(str::trim).filter(|l| !l.is_empty()) {
        match smi_row(line) {
            Some(g) if gpus.len() < MAX_GPU_ROWS => gpus.push(g),
            _ => unparsed = unparsed.saturating_add(1),
        }
    }
    (gpus, unparsed)
}

/// Reads at most `cap` bytes of `r` on a thread of its own, then keeps draining (and
/// dropping) the rest so the writer never blocks on a full pipe; sends what it kept and
/// whether more came.
fn capped_reader<R: Read + Send + 'static>(r: R, cap: usize) -> mpsc::Receiver<(Vec<u8>, bool)> {
    let (tx, rx) = mpsc::channel();
    // Without a thread the sender is dropped and the receiver reports nothing read.
    let _ = std::thread::Builder::new()
        .name("nvidia-smi-out".into())
        .spawn(move || {
            let mut r = r;
            let mut kept = Vec::new();
            let _ = (&mut r).take(cap as u64).read_to_end(&mut kept);
            let more = std::io::copy(&mut r, &mut std::io::sink()).unwrap_or(0) > 0;
            let _ = tx.send((kept, more));
        });
    rx
}

fn run_nvidia_smi(
    reaper: &Reaper,
    path: &Path,
    env: &[(String, String)],
    deadline: Duration,
) -> NvidiaSmi {
    use std::os::unix::process::CommandExt;
    let shown = clip(&path.display().to_string());
    let query = format!("--query-gpu={NVIDIA_SMI_QUERY}");
    let mut cmd = Command::new(path);
    cmd.args([query.as_str(), "--format=csv,noheader,nounits"])
        .env_clear()
        .envs(env.iter().map(|(k, v)| (k, v)))
        .current_dir("/")
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        // Its own process group, so that a kill at the deadline takes its children too.
        .process_group(0);
    let mut child = match reaper.spawn(&mut cmd) {
        Ok(c) => c,
        Err(e) => {
            return NvidiaSmi::Failed {
                path: shown,
                exit_code: None,
                message: clip(&format!("cannot start it: {e}")),
            }
        }
    };
    let stdout = child
        .stdout
        .take()
        .map(|s| capped_reader(s, MAX_NVIDIA_SMI_OUTPUT));
    let stderr = child.stderr.take().map(|s| capped_reader(s, 4096));
    let Some(code) = reaper.wait(child.pid, deadline) else {
        if let Ok(pid) = i32::try_from(child.pid) {
            let _ = killpg(Pid::from_raw(pid), Signal::SIGKILL);
        }
        reaper.wait(child.pid, KILL_GRACE);
        return NvidiaSmi::TimedOut {
            path: shown,
            after_ms: u64::try_from(deadline.as_millis()).unwrap_or(u64::MAX),
        };
    };
    // The pipes close when it exits (unless something it started keeps them open: then
    // whatever arrived within a short grace is what there is).
    let collect = |rx: Option<mpsc::Receiver<(Vec<u8>, bool)>>| {
        rx.and_then(|rx| rx.recv_timeout(Duration::from_secs(2)).ok())
            .unwrap_or_default()
    };
    let (out, more) = collect(stdout);
    let (err, _) = collect(stderr);
    let text = String::from_utf8_lossy(&out);
    if code != 0 {
        let first = text
            .lines()
            .chain(String::from_utf8_lossy(&err).lines())
            .map(str::trim)
            .find(|l| !l.is_empty())
            .unwrap_or("no output")
            .to_string();
        return NvidiaSmi::Failed {
            path: shown,
            exit_code: Some(code),
            message: clip(&first),
        };
    }
    let (gpus, unparsed_lines) = parse_smi_csv(&text);
    NvidiaSmi::Ran {
        path: shown,
        gpus,
        unparsed_lines,
        truncated: more,
    }
}

#[cfg(test)]
#[path = "gpu_tests.rs"]
mod tests;
