//! Probe tenants: short-lived tenants a verification run creates and always removes.
//!
//! Names: `tvm-verify-<run id>-<role>`, valid under the ordinary tenant-name rule, where the
//! run id is 8 random hex digits, so a probe's name cannot be one a real tenant holds (and
//! if it were, the daemon's create would refuse it with a conflict and nothing of the real
//! tenant would be touched). Each name is written to a ledger file *before* its create is
//! sent; a probe is destroyed when its [`Probe`] guard drops, whatever the check did, and
//! again by [`Probes::release_all`] after each check. A run killed outright leaves names in
//! the ledger: the next run's [`Probes::sweep`] destroys those, and only those (a tenant
//! that merely looks like a probe but is not in the ledger is reported, never touched).

use std::collections::BTreeSet;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use crate::domain::spec::{GpuRequest, GuestImage, Quotas, TenantSpec};
use crate::domain::TenantName;

use super::host::{HostError, VerifyHost};

/// The prefix of every probe tenant's name.
pub const PROBE_PREFIX: &str = "tvm-verify-";

/// A fresh run id: 8 random hex digits.
pub fn new_run_id() -> String {
    format!("{:08x}", rand::random::<u32>())
}

/// Whether `name` has the shape of a probe name (it may still not be ours: see the ledger).
pub fn looks_like_probe(name: &str) -> bool {
    name.strip_prefix(PROBE_PREFIX).is_some_and(|rest| {
        let mut parts = rest.splitn(2, '-');
        let run = parts.next().unwrap_or("");
        run.len() == 8 && run.bytes().all(|b| b.is_ascii_hexdigit()) && parts.next().is_some()
    })
}

/// The name of the probe `role` of run `run_id`, checked by the tenant-name rule.
pub fn probe_name(run_id: &str, role: &str) -> Result<TenantName, HostError> {
    TenantName::new(format!("{PROBE_PREFIX}{run_id}-{role}"))
        .map_err(|e| HostError::Failed(format!("probe name: {e}")))
}

/// A model every probe gets before it is used (`tenantvm verify --probe-model`): pushed onto
/// its disk with its own token, then its engine restarted to serve it, as a tenant would.
#[derive(Debug, Clone)]
pub struct ProbeModel {
    /// The name it is pushed under (the name the engine serves it as).
    pub name: String,
    /// Its bytes (a small model: the probes time prefill, they need no quality).
    pub bytes: Arc<Vec<u8>>,
}

/// The name a probe model is pushed under.
pub const PROBE_MODEL_NAME: &str = "verify-probe";

/// The largest probe model read (into memory, once per run).
pub const MAX_PROBE_MODEL_BYTES: u64 = 1 << 30;

impl ProbeModel {
    /// Reads the model file at `path` (at most [`MAX_PROBE_MODEL_BYTES`]).
    pub fn read(path: &Path) -> Result<ProbeModel, HostError> {
        let io = ledger_err(path);
        let len = std::fs::metadata(path).map_err(&io)?.len();
        if len > MAX_PROBE_MODEL_BYTES {
            return Err(HostError::Failed(format!(
                "the probe model {} has {len} bytes, more than {MAX_PROBE_MODEL_BYTES}: give a small model (the probes time prefill, they need no quality)",
                path.display()
            )));
        }
        Ok(ProbeModel {
            name: PROBE_MODEL_NAME.into(),
            bytes: Arc::new(std::fs::read(path).map_err(io)?),
        })
    }
}

/// The probe tenants of one run.
pub struct Probes<'h> {
    host: &'h dyn VerifyHost,
    run_id: String,
    image: Option<String>,
    model: Option<ProbeModel>,
    memory_mib: u32,
    ledger: Option<PathBuf>,
    timeout: Duration,
    live: Mutex<BTreeSet<String>>,
    problems: Mutex<Vec<String>>,
    counter: AtomicU32,
    cancel: Arc<AtomicBool>,
}

/// One probe tenant; destroyed when dropped.
pub struct Probe<'p> {
    /// Its name.
    pub name: String,
    /// Its tenant token.
    pub token: String,
    /// The spec it was created with.
    pub spec: TenantSpec,
    probes: &'p Probes<'p>,
    released: bool,
}

impl Probe<'_> {
    /// Destroys it now and reports how that went (check 10 inspects what a departure leaves).
    pub fn destroy_now(mut self) -> Result<(), HostError> {
        self.released = true;
        self.probes.release(&self.name)
    }
}

impl Drop for Probe<'_> {
    fn drop(&mut self) {
        if !self.released {
            if let Err(e) = self.probes.release(&self.name) {
                self.probes.note(format!("{}: {e}", self.name));
            }
        }
    }
}

impl<'h> Probes<'h> {
    /// The probes of run `run_id`, created from `image` (a named image of the daemon),
    /// recorded in `ledger` (none: not recorded, for tests).
    pub fn new(
        host: &'h dyn VerifyHost,
        run_id: &str,
        image: Option<String>,
        memory_mib: u32,
        ledger: Option<PathBuf>,
        timeout: Duration,
    ) -> Probes<'h> {
        Probes {
            host,
            run_id: run_id.to_string(),
            image,
            model: None,
            memory_mib,
            ledger,
            timeout,
            live: Mutex::default(),
            problems: Mutex::default(),
            counter: AtomicU32::new(0),
            cancel: Arc::default(),
        }
    }

    /// The same, refusing new probes once `cancel` is set (the run was interrupted).
    pub fn with_cancel(mut self, cancel: Arc<AtomicBool>) -> Self {
        self.cancel = cancel;
        self
    }

    /// The same, giving each probe `model` to serve before it is used.
    pub fn with_model(mut self, model: Option<ProbeModel>) -> Self {
        self.model = model;
        self
    }

    /// Whether the run was interrupted.
    pub fn cancelled(&self) -> bool {
        self.cancel.load(Ordering::Relaxed)
    }

    /// This run's id.
    pub fn run_id(&self) -> &str {
        &self.run_id
    }

    fn note(&self, problem: String) {
        self.problems
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .push(problem);
    }

    /// Creates a probe tenant (role: a few letters, e.g. `a`, `victim`) and waits until it
    /// runs; `adjust` changes its spec (disk size, quotas) before it is sent.
    pub fn create(
        &self,
        role: &str,
        adjust: impl FnOnce(&mut TenantSpec),
    ) -> Result<Probe<'_>, HostError> {
        let image = self.image.clone().ok_or_else(|| {
            HostError::Unsupported(
                "this check needs probe tenants: give --probe-image NAME (a named image of the daemon's --image-dir: the n-gram payload, or an engine's variant with --probe-model)".into(),
            )
        })?;
        if self.cancelled() {
            return Err(HostError::Failed("the run was interrupted".into()));
        }
        let n = self.counter.fetch_add(1, Ordering::Relaxed);
        let name = probe_name(&self.run_id, &format!("{role}{n}"))?;
        let mut spec = TenantSpec {
            name: name.clone(),
            vcpus: 1,
            memory_mib: self.memory_mib,
            // A guest image's agent opens its encrypted disk before it starts the payload.
            disk_gib: 1,
            gpu: GpuRequest::default(),
            image: GuestImage {
                name: Some(image),
                kernel: None,
                initramfs: None,
                cmdline: None,
            },
            quotas: Quotas::default(),
            hugepages: None,
            vgpu_licence: None,
        };
        adjust(&mut spec);
        spec.name = name.clone();
        spec.validate()
            .map_err(|e| HostError::Failed(format!("probe spec: {e}")))?;
        if let Some(ledger) = &self.ledger {
            ledger_add(ledger, name.as_str())?;
        }
        self.live
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .insert(name.to_string());
        let token = match self.host.create(&spec, self.timeout) {
            Ok(t) => t,
            Err(e) if e.status().is_some_and(|s| (400..500).contains(&s)) => {
                // Refused (a name taken, a bad spec): nothing was created, and a tenant of
                // that name, if any, is not ours to destroy.
                self.forget(name.as_str())?;
                return Err(e);
            }
            Err(e) => {
                // It may exist half-made: remove it now (the ledger keeps it otherwise).
                if let Err(e2) = self.release(name.as_str()) {
                    self.note(format!("{name}: {e2}"));
                }
                return Err(e);
            }
        };
        let probe = Probe {
            name: name.to_string(),
            token,
            spec,
            probes: self,
            released: false,
        };
        if let Some(model) = &self.model {
            // Dropping the guard on an error destroys the probe.
            self.host
                .push_model(&probe.name, &probe.token, &model.name, &model.bytes)
                .map_err(|e| HostError::Failed(format!("probe {name}: model push: {e}")))?;
            self.host
                .restart_payload(&probe.name, &probe.token, self.timeout)
                .map_err(|e| {
                    HostError::Failed(format!(
                        "probe {name}: its engine did not serve the probe model: {e}"
                    ))
                })?;
        }
        Ok(probe)
    }

    /// Drops a name that was never created from the live set and the ledger.
    fn forget(&self, name: &str) -> Result<(), HostError> {
        self.live
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .remove(name);
        match &self.ledger {
            Some(ledger) => ledger_remove(ledger, name),
            None => Ok(()),
        }
    }

    /// Destroys one probe and forgets it (from the ledger too) once it is gone.
    fn release(&self, name: &str) -> Result<(), HostError> {
        self.host.destroy(name, self.timeout)?;
        self.forget(name)
    }

    /// Destroys every probe of this run still alive; returns what went wrong (also what
    /// the guards met since the last call). Probes that could not be destroyed stay in the
    /// ledger for the next run's sweep.
    pub fn release_all(&self) -> Vec<String> {
        let names: Vec<String> = self
            .live
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .iter()
            .cloned()
            .collect();
        for name in names {
            if let Err(e) = self.release(&name) {
                self.note(format!(
                    "{name}: {e}; it stays in the ledger for the next run"
                ));
            }
        }
        std::mem::take(&mut *self.problems.lock().unwrap_or_else(|e| e.into_inner()))
    }

    /// Destroys the probes earlier runs left (named in the ledger and still present);
    /// returns one line per probe found, and per probe-like tenant left alone because it is
    /// not in the ledger.
    pub fn sweep(&self) -> Result<Vec<String>, HostError> {
        self.sweep_ledger(true)
    }

    /// [`Probes::sweep`] for an interrupted run: also destroys what the ledger names, but
    /// keeps the names of tenants not (yet) present, whose create may still be on its way,
    /// for the next run's sweep.
    pub fn sweep_interrupted(&self) -> Result<Vec<String>, HostError> {
        self.sweep_ledger(false)
    }

    fn sweep_ledger(&self, forget_absent: bool) -> Result<Vec<String>, HostError> {
        let recorded = match &self.ledger {
            Some(l) => ledger_read(l)?,
            None => BTreeSet::new(),
        };
        let mut lines = Vec::new();
        let present: BTreeSet<String> = self.host.tenants()?.into_iter().map(|t| t.name).collect();
        for name in &recorded {
            if !looks_like_probe(name) || TenantName::check(name).is_err() {
                lines.push(format!(
                    "ledger entry {:?} is not a probe name; left alone",
                    crate::untrusted::one_line(name)
                ));
                continue;
            }
            if present.contains(name) {
                match self.release(name) {
                    Ok(()) => lines.push(format!("{name}: in the probe ledger; destroyed")),
                    Err(e) => lines.push(format!(
                        "{name}: in the probe ledger; destroy failed: {e} (the next run tries again)"
                    )),
                }
            } else if let (Some(l), true) = (&self.ledger, forget_absent) {
                ledger_remove(l, name)?;
            }
        }
        for name in present.iter().filter(|n| looks_like_probe(n)) {
            if !recorded.contains(name) {
                lines.push(format!(
                    "{name}: looks like a probe but is not in the ledger; left alone (destroy it by hand if it is one)"
                ));
            }
        }
        Ok(lines)
    }
}

fn ledger_err(path: &Path) -> impl Fn(std::io::Error) -> HostError + '_ {
    move |e| HostError::Io {
        path: path.display().to_string(),
        message: e.to_string(),
    }
}

fn ledger_read(path: &Path) -> Result<BTreeSet<String>, HostError> {
    match std::fs::read_to_string(path) {
        Ok(text) => Ok(text
            .lines()
            .map(str::trim)
            .filter(|l| !l.is_empty())
            .map(str::to_string)
            .collect()),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(BTreeSet::new()),
        Err(e) => Err(ledger_err(path)(e)),
    }
}

fn ledger_add(path: &Path, name: &str) -> Result<(), HostError> {
    if let Some(dir) = path.parent() {
        std::fs::create_dir_all(dir).map_err(ledger_err(path))?;
    }
    let mut f = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(path)
        .map_err(ledger_err(path))?;
    writeln!(f, "{name}")
        .and_then(|()| f.sync_all())
        .map_err(ledger_err(path))
}

fn ledger_remove(path: &Path, name: &str) -> Result<(), HostError> {
    let mut names = ledger_read(path)?;
    if !names.remove(name) {
        return Ok(());
    }
    let text: String = names.iter().map(|n| format!("{n}\n")).collect();
    let tmp = path.with_extension("tmp");
    std::fs::write(&tmp, text)
        .and_then(|()| std::fs::rename(&tmp, path))
        .map_err(ledger_err(path))
}
