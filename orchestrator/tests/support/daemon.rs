//! A real `tenantvmd` in a temporary state directory, with an image directory holding the
//! idle test guest, and helpers to inspect the host (processes, cgroups) and the store.

use std::fs;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use tenantvm::client::Client;
use tenantvm::domain::lifecycle::LifecycleState;
use tenantvm::store::Store;

/// Why the end-to-end tests cannot run here, if they cannot.
pub fn skip_reason() -> Option<String> {
    // SAFETY: geteuid has no preconditions and touches no memory.
    if unsafe { libc::geteuid() } != 0 {
        return Some("needs root (jails set uids, cgroups and namespaces)".into());
    }
    if let Err(e) = fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open("/dev/kvm")
    {
        return Some(format!("/dev/kvm is not usable ({e})"));
    }
    if !vmm_binary().is_file() {
        return Some(format!(
            "{} is not built (cargo build -p tenantvm-vmm)",
            vmm_binary().display()
        ));
    }
    if !jail_binary().is_file() {
        return Some(format!(
            "{} is not built (cargo build -p tenantvm-jail)",
            jail_binary().display()
        ));
    }
    if Command::new("python3").arg("--version").output().is_err() {
        return Some("python3 is missing (it writes the idle test guest)".into());
    }
    None
}

/// Whether tenantvmd lacks the crash hook (built without `--features test-hooks`, which
/// scripts/test.sh passes): records the skip of `test` (tenantvm-skip) and returns true if so.
pub fn skip_without_crash_hook(test: &str) -> bool {
    if cfg!(feature = "test-hooks") {
        return false;
    }
    tenantvm_skip::record(
        &format!("{}::{test}", env!("CARGO_CRATE_NAME")),
        "tenantvmd is built without its crash hook; run `cargo test -p tenantvm --features test-hooks` (scripts/test.sh does)",
    );
    true
}

/// Records the skip of `test` (tenantvm-skip) and returns true if it must skip.
pub fn should_skip(test: &str) -> bool {
    match skip_reason() {
        Some(why) => {
            tenantvm_skip::record(&format!("{}::{test}", env!("CARGO_CRATE_NAME")), why);
            true
        }
        None => false,
    }
}

fn repo_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("..")
}

/// The built no_std test guest, if scripts/build-test-guests.sh ran.
pub fn test_guest() -> Option<PathBuf> {
    let p = repo_root().join("target/test-guests/tvm-testguest");
    p.is_file().then_some(p)
}

/// tenantvm-vmm next to tenantvmd in the target directory.
pub fn vmm_binary() -> PathBuf {
    Path::new(env!("CARGO_BIN_EXE_tenantvmd")).with_file_name("tenantvm-vmm")
}

/// tenantvm-jail next to tenantvmd in the target directory (a binary of the jail crate,
/// orchestrator/jail, which tenantvmd looks for beside itself).
pub fn jail_binary() -> PathBuf {
    Path::new(env!("CARGO_BIN_EXE_tenantvmd")).with_file_name("tenantvm-jail")
}

/// A running (or stopped) daemon and its directories.
pub struct TestDaemon {
    /// Temp root: state/, img/, d.sock.
    pub dir: tempfile::TempDir,
    child: Option<Child>,
    extra_args: Vec<String>,
    uid_first: u32,
    nofile: Option<(u64, u64)>,
}

/// Distinct uid ranges for the daemons of one test process.
static NEXT_RANGE: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);

impl TestDaemon {
    /// Prepares the directories and the idle guest image; does not start the daemon.
    pub fn new() -> TestDaemon {
        // Short paths: the VMM's control socket path must fit in 108 bytes.
        let dir = tempfile::Builder::new()
            .prefix("tvm")
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
        // The no_std test guest (scripts/build-test-guests.sh), idling: it prints
        // `TVMTEST idle READY` and then a tick every 100 ms (busy-waiting between ticks).
        if let Some(guest) = test_guest() {
            let dir = dir.path().join("img/testguest");
            fs::create_dir_all(&dir).unwrap();
            fs::copy(guest, dir.join("kernel")).unwrap();
            fs::write(dir.join("cmdline"), "console=ttyS0 tvm.test=idle").unwrap();
        }
        // Daemons of parallel tests must not hand out the same uids.
        let slot = (std::process::id() % 4096) * 64
            + NEXT_RANGE.fetch_add(1, std::sync::atomic::Ordering::Relaxed) % 64;
        TestDaemon {
            dir,
            child: None,
            extra_args: Vec::new(),
            uid_first: 1_000_000 + slot * 64,
            nofile: None,
        }
    }

    /// Starts the daemon at these `RLIMIT_NOFILE` soft and hard limits (as systemd starts a
    /// service at a soft 1,024).
    pub fn with_nofile(mut self, soft: u64, hard: u64) -> TestDaemon {
        self.nofile = Some((soft, hard));
        self
    }

    /// Adds daemon arguments for every start.
    pub fn with_args(mut self, args: &[&str]) -> TestDaemon {
        self.extra_args.extend(args.iter().map(|s| s.to_string()));
        self
    }

    /// Runs with `--gpu-backend sim:` over a private copy of the simulated GPU host
    /// `tests/fixtures/hosts/sim-mixed.json` (the daemon writes its MIG changes there);
    /// also returns that copy's path.
    pub fn with_sim_gpu_host(self) -> (TestDaemon, PathBuf) {
        let sim = self.dir.path().join("gpu-host.json");
        fs::copy(
            repo_root().join("tests/fixtures/hosts/sim-mixed.json"),
            &sim,
        )
        .unwrap();
        let arg = format!("sim:{}", sim.display());
        (self.with_args(&["--gpu-backend", &arg]), sim)
    }

    /// The state directory.
    pub fn state_dir(&self) -> PathBuf {
        self.dir.path().join("state")
    }

    /// The API socket.
    pub fn socket(&self) -> PathBuf {
        self.dir.path().join("d.sock")
    }

    /// Starts the daemon (with `crash_at` armed if given), waits for its socket, and then
    /// for its recovery after the start to finish (the health check says so).
    pub fn start(&mut self, crash_at: Option<&str>) {
        self.start_serving(crash_at);
        self.wait_recovered(Duration::from_secs(600));
    }

    /// The daemon's `GET /v1/health` answer, read with a plain blocking request.
    pub fn health(&self) -> Option<serde_json::Value> {
        use std::io::{Read, Write};
        let mut conn = std::os::unix::net::UnixStream::connect(self.socket()).ok()?;
        conn.set_read_timeout(Some(Duration::from_secs(10))).ok()?;
        write!(
            conn,
            "GET /v1/health HTTP/1.1\r\nHost: tenantvmd\r\nAuthorization: Bearer {}\r\nConnection: close\r\n\r\n",
            self.admin_token()
        )
        .ok()?;
        let mut answer = String::new();
        conn.read_to_string(&mut answer).ok()?;
        let (_, body) = answer.split_once("\r\n\r\n")?;
        serde_json::from_str(body).ok()
    }

    /// Waits until the daemon's recovery after its start is done.
    pub fn wait_recovered(&mut self, timeout: Duration) {
        let deadline = Instant::now() + timeout;
        loop {
            if let Some(h) = self.health() {
                // (A daemon without the field recovers before it serves.)
                if h.get("recovering") != Some(&serde_json::Value::Bool(true)) {
                    return;
                }
            }
            if let Some(status) = self.child.as_mut().and_then(|c| c.try_wait().unwrap()) {
                panic!(
                    "tenantvmd exited while recovering ({status}):\n{}",
                    self.log()
                );
            }
            assert!(
                Instant::now() < deadline,
                "tenantvmd did not finish recovering in {timeout:?}:\n{}",
                self.log()
            );
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// Starts the daemon (with `crash_at` armed if given) and returns as soon as its socket
    /// answers, recovery or not.
    pub fn start_serving(&mut self, crash_at: Option<&str>) {
        assert!(self.child.is_none(), "daemon already running");
        assert!(
            crash_at.is_none() || cfg!(feature = "test-hooks"),
            "the crash hook needs `--features test-hooks` (check skip_without_crash_hook first)"
        );
        let _ = fs::remove_file(self.socket());
        let log = fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(self.dir.path().join("daemon.log"))
            .unwrap();
        let mut cmd = Command::new(env!("CARGO_BIN_EXE_tenantvmd"));
        cmd.arg("--state-dir")
            .arg(self.state_dir())
            .arg("--socket")
            .arg(self.socket())
            .arg("--image-dir")
            .arg(self.dir.path().join("img"))
            .arg("--vmm-binary")
            .arg(vmm_binary())
            .arg("--uid-range")
            .arg(format!("{}:64", self.uid_first))
            // Tests run many 1-vCPU tenants on a 2-core machine: an explicit overcommit.
            .arg("--vcpu-overcommit")
            .arg("32")
            .args(&self.extra_args)
            .env_remove("TENANTVM_TEST_CRASH_AT")
            // A private host KEK and the cheap test keyslot cost, never /etc/tenantvm.
            .env("TENANTVMD_KEK_FILE", self.dir.path().join("host-kek"))
            .env("TENANTVMD_KEYSLOT_COST", "test")
            .env_remove("CREDENTIALS_DIRECTORY")
            .stdin(Stdio::null())
            .stdout(log.try_clone().unwrap())
            .stderr(log);
        if let Some(at) = crash_at {
            cmd.env("TENANTVM_TEST_CRASH_AT", at);
        }
        if let Some((soft, hard)) = self.nofile {
            use std::os::unix::process::CommandExt;
            let limit = libc::rlimit {
                rlim_cur: soft,
                rlim_max: hard,
            };
            // SAFETY: setrlimit is async-signal-safe and changes only the child's limits;
            // `limit` is a plain value copied into the closure.
            unsafe {
                cmd.pre_exec(move || {
                    if libc::setrlimit(libc::RLIMIT_NOFILE, &limit) != 0 {
                        return Err(std::io::Error::last_os_error());
                    }
                    Ok(())
                });
            }
        }
        let child = cmd.spawn().unwrap();
        self.child = Some(child);
        let deadline = Instant::now() + Duration::from_secs(60);
        // The socket file appears at bind(2), a moment before listen(2): until then a connect
        // is refused. Wait for a connection, not for the file.
        while std::os::unix::net::UnixStream::connect(self.socket()).is_err() {
            if let Some(status) = self.child.as_mut().unwrap().try_wait().unwrap() {
                panic!("tenantvmd exited at start ({status}):\n{}", self.log());
            }
            assert!(
                Instant::now() < deadline,
                "tenantvmd did not start:\n{}",
                self.log()
            );
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// The daemon's pid while it runs.
    pub fn pid(&self) -> Option<u32> {
        self.child.as_ref().map(Child::id)
    }

    /// The daemon's output so far.
    pub fn log(&self) -> String {
        fs::read_to_string(self.dir.path().join("daemon.log")).unwrap_or_default()
    }

    /// Waits for the daemon to die on its own (the crash hook); panics after `timeout`.
    pub fn wait_for_death(&mut self, timeout: Duration) -> std::process::ExitStatus {
        let child = self.child.as_mut().expect("daemon running");
        let deadline = Instant::now() + timeout;
        loop {
            if let Some(status) = child.try_wait().unwrap() {
                self.child = None;
                return status;
            }
            assert!(
                Instant::now() < deadline,
                "tenantvmd did not die:\n{}",
                self.log()
            );
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// SIGTERMs the daemon and waits for it.
    pub fn stop(&mut self) {
        if let Some(mut child) = self.child.take() {
            // SAFETY: kill(2) on the pid of a child we spawned and have not reaped.
            unsafe { libc::kill(child.id() as i32, libc::SIGTERM) };
            let _ = child.wait();
        }
    }

    /// The file the daemon wrote the admin token to (for `--token-file`).
    pub fn admin_token_file(&self) -> PathBuf {
        self.state_dir().join("admin.token")
    }

    /// The admin token.
    pub fn admin_token(&self) -> String {
        fs::read_to_string(self.admin_token_file())
            .unwrap()
            .trim()
            .to_string()
    }

    /// Whether tenant `name` is in `want` (as the admin sees it) within `timeout`.
    pub async fn reaches(&self, name: &str, want: LifecycleState, timeout: Duration) -> bool {
        let admin = self.admin();
        eventually(timeout, || {
            let admin = admin.clone();
            async move { admin.status(name).await.is_ok_and(|t| t.state == want) }
        })
        .await
    }

    /// Waits up to 60 s for tenant `name` to be in `want`; fails the test otherwise, with the
    /// tenant's last status and the daemon's log.
    pub async fn wait_state(&self, name: &str, want: LifecycleState) {
        let ok = self.reaches(name, want, Duration::from_secs(60)).await;
        let t = self.admin().status(name).await;
        assert!(ok, "{name} never reached {want}: {t:?}\n{}", self.log());
    }

    /// Whether the daemon no longer knows tenant `name` (its destroy finished) within
    /// `timeout`.
    pub async fn forgets(&self, name: &str, timeout: Duration) -> bool {
        let admin = self.admin();
        eventually(timeout, || {
            let admin = admin.clone();
            async move { admin.status(name).await.is_err() }
        })
        .await
    }

    /// A client with the admin token.
    pub fn admin(&self) -> Client {
        Client::new(self.socket(), self.admin_token())
    }

    /// A client with another token.
    pub fn client(&self, token: &str) -> Client {
        Client::new(self.socket(), token)
    }

    /// A connection to the daemon's store (WAL: safe next to the daemon).
    pub fn store(&self) -> Store {
        Store::open(&self.state_dir().join("state.db")).unwrap()
    }
}

impl Drop for TestDaemon {
    fn drop(&mut self) {
        if let Some(mut child) = self.child.take() {
            // SAFETY: kill(2) on the pid of a child we spawned and have not reaped.
            unsafe { libc::kill(child.id() as i32, libc::SIGKILL) };
            let _ = child.wait();
        }
        // Leave no VM or cgroup behind, whatever the test did.
        let names: Vec<String> = fs::read_dir(self.state_dir().join("tenants"))
            .map(|d| {
                d.flatten()
                    .map(|e| e.file_name().to_string_lossy().into_owned())
                    .collect()
            })
            .unwrap_or_default();
        let scoped =
            tenantvm::jail::Cgroups::detect().and_then(|c| c.for_state_dir(&self.state_dir()));
        if let Ok(cgroups) = scoped {
            let mut all = names;
            if let Ok(store) = Store::open(&self.state_dir().join("state.db")) {
                all.extend(
                    store
                        .list_tenants(true)
                        .unwrap_or_default()
                        .into_iter()
                        .map(|t| t.name.to_string()),
                );
            }
            for name in all {
                let dir = self.state_dir().join("tenants").join(&name);
                let _ = tenantvm::jail::cleanup_tenant(&cgroups, &name, &dir);
            }
            // The daemon's own subtree, now empty (rmdir refuses one that is not).
            let root = Path::new(tenantvm::jail::cgroup::DEFAULT_CGROUP_ROOT);
            for hierarchy in ["", "memory", "cpu", "pids", "blkio"] {
                let _ = fs::remove_dir(root.join(hierarchy).join(cgroups.subtree()));
            }
        }
    }
}

/// Pids of processes in the tenant's cgroup(s) according to /proc/PID/cgroup, in any
/// daemon's subtree (`/tenantvm/<daemon id>/<tenant>`; names are unique per test process).
pub fn processes_in_cgroup_of(tenant: &str) -> Vec<i32> {
    let leaf = format!("/{tenant}");
    let mut out = Vec::new();
    for entry in fs::read_dir("/proc").unwrap().flatten() {
        let Ok(pid) = entry.file_name().to_string_lossy().parse::<i32>() else {
            continue;
        };
        let Ok(cg) = fs::read_to_string(entry.path().join("cgroup")) else {
            continue;
        };
        if cg
            .lines()
            .any(|l| l.contains("/tenantvm/") && l.ends_with(&leaf))
        {
            out.push(pid);
        }
    }
    out
}

/// Pids of processes running as `uid`.
pub fn processes_of_uid(uid: u32) -> Vec<i32> {
    let mut out = Vec::new();
    for entry in fs::read_dir("/proc").unwrap().flatten() {
        let Ok(pid) = entry.file_name().to_string_lossy().parse::<i32>() else {
            continue;
        };
        let Ok(status) = fs::read_to_string(entry.path().join("status")) else {
            continue;
        };
        let real = status
            .lines()
            .find(|l| l.starts_with("Uid:"))
            .and_then(|l| l.split_whitespace().nth(1))
            .and_then(|u| u.parse::<u32>().ok());
        if real == Some(uid) {
            out.push(pid);
        }
    }
    out
}

/// Whether the tenant has a cgroup directory in any hierarchy, in any daemon's subtree
/// (`tenantvm/<daemon id>/<tenant>`) or directly under `tenantvm/`.
pub fn cgroup_exists(tenant: &str) -> bool {
    let root = Path::new(tenantvm::jail::cgroup::DEFAULT_CGROUP_ROOT);
    let parents: Vec<PathBuf> = if root.join("cgroup.controllers").exists() {
        vec![root.join("tenantvm")]
    } else {
        ["memory", "cpu", "pids"]
            .iter()
            .map(|c| root.join(c).join("tenantvm"))
            .collect()
    };
    parents.iter().any(|parent| {
        parent.join(tenant).is_dir()
            || fs::read_dir(parent)
                .is_ok_and(|d| d.flatten().any(|e| e.path().join(tenant).is_dir()))
    })
}

/// A tenant name unique to this test process (tests share the host's cgroup tree).
pub fn unique(name: &str) -> String {
    format!("{name}-{}", std::process::id())
}

/// Polls until `f` is true or `timeout` passes.
pub async fn eventually<F, Fut>(timeout: Duration, mut f: F) -> bool
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = bool>,
{
    let deadline = Instant::now() + timeout;
    loop {
        if f().await {
            return true;
        }
        if Instant::now() >= deadline {
            return false;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}
