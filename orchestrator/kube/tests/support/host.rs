//! A simulated GPU host: a real tenantvmd (test guests on this host's KVM under
//! tenantvm-vmm, a simulated GPU inventory of its own, `--gpu-backend sim:FILE`) and its node
//! agent, `tenantvm-node`, as plain processes.

use std::fs;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use super::cluster::repo_root;

/// Where the workspace's binaries are (next to this test's own binaries).
fn bin(name: &str) -> PathBuf {
    Path::new(env!("CARGO_BIN_EXE_tenantvm-node")).with_file_name(name)
}

/// Why simulated hosts cannot run here, if they cannot.
pub fn skip_reason() -> Option<String> {
    // SAFETY: geteuid has no preconditions and touches no memory.
    if unsafe { libc::geteuid() } != 0 {
        return Some("needs root (tenantvmd jails set uids, cgroups and namespaces)".into());
    }
    if let Err(e) = fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open("/dev/kvm")
    {
        return Some(format!("/dev/kvm is not usable ({e})"));
    }
    for b in ["tenantvmd", "tenantvm-vmm", "tenantvm-jail"] {
        if !bin(b).is_file() {
            return Some(format!(
                "{} is not built (cargo build -p tenantvm -p tenantvm-vmm -p tenantvm-jail --bins; scripts/test.sh does)",
                bin(b).display()
            ));
        }
    }
    None
}

/// The host's GPUs: (database model, PCI address) each.
pub fn sim_file(gpus: &[(&str, &str)]) -> String {
    let list: Vec<serde_json::Value> = gpus
        .iter()
        .enumerate()
        .map(|(i, (model, pci))| {
            let mig = tenantvm_gpu::mig::model_by_key(model).unwrap().has_mig();
            serde_json::json!({
                "index": i, "model": model, "pci_address": pci, "mig_enabled": mig,
                "instances": [], "iommu_group": 40 + i,
            })
        })
        .collect();
    serde_json::json!({ "gpus": list }).to_string()
}

/// One simulated host.
pub struct Host {
    /// The node's name.
    pub name: String,
    /// state/, img/, d.sock, logs.
    pub dir: tempfile::TempDir,
    daemon: Option<Child>,
    agent: Option<Child>,
    kubeconfig: PathBuf,
    uid_first: u32,
}

impl Host {
    /// Starts tenantvmd with these GPUs and, with `kubeconfig`, the node agent.
    pub fn start(name: &str, gpus: &[(&str, &str)], kubeconfig: &Path, slot: u32) -> Host {
        // Short paths: the VMM's control socket path must fit in 108 bytes.
        let dir = tempfile::Builder::new()
            .prefix("tvk")
            .tempdir_in("/tmp")
            .unwrap();
        let img = dir.path().join("img/idle");
        fs::create_dir_all(&img).unwrap();
        let status = Command::new("python3")
            .arg(repo_root().join("scripts/make-idle-guest.py"))
            .arg(img.join("kernel"))
            .arg("hello from the idle guest")
            .status()
            .unwrap();
        assert!(status.success());
        fs::write(img.join("cmdline"), "console=ttyS0").unwrap();
        fs::write(dir.path().join("gpus.json"), sim_file(gpus)).unwrap();
        let mut host = Host {
            name: name.into(),
            dir,
            daemon: None,
            agent: None,
            kubeconfig: kubeconfig.into(),
            uid_first: 2_000_000 + (std::process::id() % 512) * 4096 + slot * 256,
        };
        host.start_daemon();
        host.start_agent();
        host
    }

    /// tenantvmd's socket.
    pub fn socket(&self) -> PathBuf {
        self.dir.path().join("d.sock")
    }

    fn state(&self) -> PathBuf {
        self.dir.path().join("state")
    }

    /// Starts tenantvmd and waits for its socket and its recovery.
    pub fn start_daemon(&mut self) {
        assert!(self.daemon.is_none());
        let _ = fs::remove_file(self.socket());
        let log = self.log_file("daemon.log");
        let child = Command::new(bin("tenantvmd"))
            .arg("--state-dir")
            .arg(self.state())
            .arg("--socket")
            .arg(self.socket())
            .arg("--image-dir")
            .arg(self.dir.path().join("img"))
            .arg("--vmm-binary")
            .arg(bin("tenantvm-vmm"))
            .arg("--uid-range")
            .arg(format!("{}:256", self.uid_first))
            .arg("--vcpu-overcommit")
            .arg("64")
            .arg("--gpu-backend")
            .arg(format!(
                "sim:{}",
                self.dir.path().join("gpus.json").display()
            ))
            .env("TENANTVMD_KEK_FILE", self.dir.path().join("host-kek"))
            .env("TENANTVMD_KEYSLOT_COST", "test")
            .env_remove("TENANTVM_TEST_CRASH_AT")
            .env_remove("CREDENTIALS_DIRECTORY")
            .stdin(Stdio::null())
            .stdout(log.try_clone().unwrap())
            .stderr(log)
            .spawn()
            .unwrap();
        self.daemon = Some(child);
        let deadline = Instant::now() + Duration::from_secs(60);
        loop {
            if let Some(h) = self.health() {
                if h.get("recovering") != Some(&serde_json::Value::Bool(true)) {
                    return;
                }
            }
            assert!(
                Instant::now() < deadline,
                "tenantvmd of {} did not start:\n{}",
                self.name,
                self.log("daemon.log")
            );
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    fn health(&self) -> Option<serde_json::Value> {
        use std::io::{Read, Write};
        let mut conn = std::os::unix::net::UnixStream::connect(self.socket()).ok()?;
        conn.set_read_timeout(Some(Duration::from_secs(5))).ok()?;
        write!(
            conn,
            "GET /v1/health HTTP/1.1\r\nHost: tenantvmd\r\nAuthorization: Bearer {}\r\nConnection: close\r\n\r\n",
            self.admin_token()
        )
        .ok()?;
        let mut answer = String::new();
        conn.read_to_string(&mut answer).ok()?;
        serde_json::from_str(answer.split_once("\r\n\r\n")?.1).ok()
    }

    /// The daemon's admin token.
    pub fn admin_token(&self) -> String {
        fs::read_to_string(self.state().join("admin.token"))
            .unwrap_or_default()
            .trim()
            .to_string()
    }

    /// An admin client of the daemon.
    pub fn admin(&self) -> tenantvm::client::Client {
        tenantvm::client::Client::new(self.socket(), self.admin_token())
    }

    /// Starts the node agent.
    pub fn start_agent(&mut self) {
        assert!(self.agent.is_none());
        let log = self.log_file("agent.log");
        let child = Command::new(bin("tenantvm-node"))
            .arg("--node")
            .arg(&self.name)
            .arg("--socket")
            .arg(self.socket())
            .arg("--token-file")
            .arg(self.state().join("admin.token"))
            .arg("--receipt-key")
            .arg(self.state().join("audit/receipt-signing.key.pub"))
            .arg("--endpoint")
            .arg(format!("https://{}.test:8443", self.name))
            .args([
                "--lease-s",
                "6",
                "--daemon-timeout-s",
                "3",
                "--resync-s",
                "2",
            ])
            .env("KUBECONFIG", &self.kubeconfig)
            .env("TENANTVM_LOG", "info,kube=warn")
            .stdin(Stdio::null())
            .stdout(log.try_clone().unwrap())
            .stderr(log)
            .spawn()
            .unwrap();
        self.agent = Some(child);
    }

    /// Sends `signal` to the node agent; with SIGKILL or SIGTERM, reaps it.
    pub fn signal_agent(&mut self, signal: i32) {
        signal_child(&mut self.agent, signal);
    }

    /// Sends `signal` to tenantvmd; with SIGKILL or SIGTERM, reaps it.
    pub fn signal_daemon(&mut self, signal: i32) {
        signal_child(&mut self.daemon, signal);
    }

    fn log_file(&self, name: &str) -> fs::File {
        fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(self.dir.path().join(name))
            .unwrap()
    }

    /// A log of this host (`daemon.log`, `agent.log`).
    pub fn log(&self, name: &str) -> String {
        fs::read_to_string(self.dir.path().join(name)).unwrap_or_default()
    }
}

fn signal_child(child: &mut Option<Child>, signal: i32) {
    let Some(c) = child.as_mut() else {
        return;
    };
    // SAFETY: kill(2) on the pid of a child this process spawned and has not reaped.
    unsafe { libc::kill(c.id() as i32, signal) };
    if signal == libc::SIGKILL || signal == libc::SIGTERM {
        let _ = c.wait();
        *child = None;
    }
}

impl Drop for Host {
    fn drop(&mut self) {
        signal_child(&mut self.agent, libc::SIGKILL);
        signal_child(&mut self.daemon, libc::SIGCONT);
        signal_child(&mut self.daemon, libc::SIGKILL);
        // Leave no VM or cgroup behind, whatever the test did.
        let state = self.state();
        let Ok(cgroups) = tenantvm::jail::Cgroups::detect().and_then(|c| c.for_state_dir(&state))
        else {
            return;
        };
        let names: Vec<String> = fs::read_dir(state.join("tenants"))
            .map(|d| {
                d.flatten()
                    .map(|e| e.file_name().to_string_lossy().into_owned())
                    .collect()
            })
            .unwrap_or_default();
        for name in names {
            let _ =
                tenantvm::jail::cleanup_tenant(&cgroups, &name, &state.join("tenants").join(&name));
        }
        let root = Path::new(tenantvm::jail::cgroup::DEFAULT_CGROUP_ROOT);
        for hierarchy in ["", "memory", "cpu", "pids", "blkio"] {
            let _ = fs::remove_dir(root.join(hierarchy).join(cgroups.subtree()));
        }
    }
}
