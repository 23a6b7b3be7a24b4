//! Bounded test loads ([`tenantvm_agent_protocol::load`]): the agent starts each in a child
//! process (this binary again, `tenantvm-agent load-worker ...`) so that the guest's OOM
//! killer can take it without taking the agent, follows its progress lines, and kills it
//! when it overruns its deadline. [`Loads`] is the agent's side; [`run_worker`] the
//! child's.
//!
//! The worker makes itself the OOM killer's first choice (`oom_score_adj` 1000). A memory
//! load touches every page of what it allocates, so the memory is really taken; a CPU load
//! spins threads; a disk load rewrites and fsyncs one file on the data disk and removes it;
//! a GPU memory load allocates device memory through the CUDA driver ([`crate::cuda`])
//! until the driver says out of memory, holds it, and frees it; a GPU compute load keeps
//! the GPU busy with a multiply-add kernel ([`crate::cuda_compute`]).

use std::collections::HashMap;
use std::io::{BufRead, BufReader, Read, Seek, SeekFrom, Write};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use nix::sys::signal::{kill, Signal};
use nix::unistd::Pid;
use tenantvm_agent_protocol::{LoadKind, LoadReport, LoadSpec, LoadState};

use crate::reaper::Reaper;

/// The worker's first argument.
pub const WORKER_ARG: &str = "load-worker";
/// The disk load's file, in the data directory (removed when the load ends).
pub const DISK_LOAD_FILE: &str = ".tenantvm-load";
/// How long past its `seconds` a load may run before the agent kills it (touching memory
/// under pressure and fsyncs under emulation are slow).
const GRACE: Duration = Duration::from_secs(30);
/// The longest error line kept.
const MAX_ERROR: usize = 200;

/// Why a load could not be started.
#[derive(Debug, thiserror::Error)]
pub enum LoadError {
    /// The spec is out of its caps.
    #[error("{0}")]
    Spec(#[from] tenantvm_agent_protocol::LoadSpecError),
    /// One of this kind already runs.
    #[error("a {0} load is already running; ask load-status and wait for it to end")]
    Busy(&'static str),
    /// A disk load needs the data disk mounted.
    #[error("the data disk is not mounted; a disk load writes there")]
    NotMounted,
    /// A disk load may take at most half the free space.
    #[error("a {asked} MiB disk load needs twice that free on the data disk ({free} MiB free)")]
    NoSpace {
        /// MiB asked.
        asked: u32,
        /// MiB free.
        free: u64,
    },
    /// Spawning the worker failed.
    #[error("starting the load worker failed: {0}")]
    Spawn(std::io::Error),
}

struct Slot {
    spec: LoadSpec,
    pid: u32,
    started: Instant,
    oom_before: u64,
    progress: Arc<AtomicU64>,
    error: Arc<Mutex<Option<String>>>,
    /// State, exit code, elapsed and OOM kills once it ended.
    end: Option<(LoadState, i32, Duration, u64)>,
}

/// The loads the agent runs, one per kind at a time.
#[derive(Clone, Default)]
pub struct Loads {
    slots: Arc<Mutex<HashMap<LoadKind, Slot>>>,
    stopping: Arc<AtomicBool>,
}

fn meminfo_total_mib() -> u64 {
    std::fs::read_to_string("/proc/meminfo")
        .ok()
        .and_then(|s| {
            s.lines()
                .find_map(|l| l.strip_prefix("MemTotal:"))
                .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<u64>().ok())
        })
        .map_or(0, |kib| kib >> 10)
}

/// The guest kernel's count of OOM kills (`/proc/vmstat` `oom_kill`), 0 when unreadable.
pub fn oom_kills() -> u64 {
    std::fs::read_to_string("/proc/vmstat")
        .ok()
        .and_then(|s| {
            s.lines()
                .find_map(|l| l.strip_prefix("oom_kill "))
                .and_then(|v| v.trim().parse().ok())
        })
        .unwrap_or(0)
}

fn free_mib(dir: &Path) -> u64 {
    nix::sys::statvfs::statvfs(dir).map_or(0, |s| {
        s.blocks_available().saturating_mul(s.fragment_size()) >> 20
    })
}

impl Loads {
    /// Starts `spec` through `reaper`; `data_dir` is the mounted data directory (needed
    /// by a disk load). Returns the worker's pid.
    pub fn start(
        &self,
        reaper: &Reaper,
        spec: LoadSpec,
        data_dir: Option<&Path>,
    ) -> Result<u32, LoadError> {
        spec.check()?;
        let mut slots = self.slots.lock().unwrap_or_else(|p| p.into_inner());
        if slots.get(&spec.kind).is_some_and(|s| s.end.is_none()) {
            return Err(LoadError::Busy(spec.kind.as_str()));
        }
        let dir = match (spec.kind, data_dir) {
            (LoadKind::Disk, None) => return Err(LoadError::NotMounted),
            (LoadKind::Disk, Some(d)) => {
                let free = free_mib(d);
                if u64::from(spec.amount) * 2 > free {
                    return Err(LoadError::NoSpace {
                        asked: spec.amount,
                        free,
                    });
                }
                d.to_path_buf()
            }
            (_, _) => PathBuf::from("/"),
        };
        let mut cmd = Command::new("/proc/self/exe");
        cmd.arg(WORKER_ARG)
            .arg(spec.kind.as_str())
            .arg(spec.amount.to_string())
            .arg(spec.seconds.to_string())
            .arg(&dir)
            .env_clear()
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped());
        let oom_before = oom_kills();
        let mut child = reaper.spawn(&mut cmd).map_err(LoadError::Spawn)?;
        let progress = Arc::new(AtomicU64::new(0));
        let error = Arc::new(Mutex::new(None));
        if let Some(out) = child.stdout.take() {
            let progress = Arc::clone(&progress);
            let _ = std::thread::Builder::new()
                .name("load-progress".into())
                .spawn(move || {
                    for line in BufReader::new(out).lines().map_while(Result::ok) {
                        if let Some(n) = line.strip_prefix("progress ") {
                            if let Ok(n) = n.trim().parse() {
                                progress.store(n, Ordering::Relaxed);
                            }
                        }
                    }
                });
        }
        if let Some(err) = child.stderr.take() {
            let error = Arc::clone(&error);
            let _ = std::thread::Builder::new()
                .name("load-stderr".into())
                .spawn(move || {
                    // At most 64 KiB read: a worker's error is one line.
                    let mut text = String::new();
                    let _ = err.take(64 << 10).read_to_string(&mut text);
                    if let Some(last) = text.lines().rev().find(|l| !l.trim().is_empty()) {
                        let mut last = last.to_string();
                        last.truncate(MAX_ERROR);
                        *error.lock().unwrap_or_else(|p| p.into_inner()) = Some(last);
                    }
                });
        }
        let pid = child.pid;
        slots.insert(
            spec.kind,
            Slot {
                spec,
                pid,
                started: Instant::now(),
                oom_before,
                progress,
                error,
                end: None,
            },
        );
        drop(slots);
        let me = self.clone();
        let reaper = reaper.clone();
        let deadline = Duration::from_secs(u64::from(spec.seconds)) + GRACE;
        let _ = std::thread::Builder::new()
            .name("load-monitor".into())
            .spawn(move || me.follow(&reaper, spec.kind, pid, deadline, dir));
        Ok(pid)
    }

    /// Waits for the worker `pid` of `kind` (killing it past `deadline`) and records how it
    /// ended.
    fn follow(&self, reaper: &Reaper, kind: LoadKind, pid: u32, deadline: Duration, dir: PathBuf) {
        let (state, code) = match reaper.wait(pid, deadline) {
            Some(code) => (classify(code, self.stopping.load(Ordering::Relaxed)), code),
            None => {
                let _ = kill(Pid::from_raw(pid as i32), Signal::SIGKILL);
                let code = reaper.wait(pid, Duration::from_secs(10)).unwrap_or(-1);
                (LoadState::TimedOut, code)
            }
        };
        if kind == LoadKind::Disk {
            // A worker killed mid-write leaves its file: remove it.
            let _ = std::fs::remove_file(dir.join(DISK_LOAD_FILE));
        }
        let mut slots = self.slots.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(slot) = slots.get_mut(&kind).filter(|s| s.pid == pid) {
            let ooms = oom_kills().saturating_sub(slot.oom_before);
            slot.end = Some((state, code, slot.started.elapsed(), ooms));
        }
    }

    /// The latest load of `kind`.
    pub fn report(&self, kind: LoadKind) -> LoadReport {
        let slots = self.slots.lock().unwrap_or_else(|p| p.into_inner());
        let total = meminfo_total_mib();
        let Some(s) = slots.get(&kind) else {
            return LoadReport {
                spec: None,
                state: LoadState::Idle,
                elapsed_ms: 0,
                progress: 0,
                exit_code: None,
                oom_kills: 0,
                guest_mem_total_mib: total,
                error: None,
            };
        };
        let (state, exit_code, elapsed, ooms) = match s.end {
            Some((state, code, elapsed, ooms)) => (state, Some(code), elapsed, ooms),
            None => (
                LoadState::Running,
                None,
                s.started.elapsed(),
                oom_kills().saturating_sub(s.oom_before),
            ),
        };
        let error = if state == LoadState::Failed {
            s.error.lock().unwrap_or_else(|p| p.into_inner()).clone()
        } else {
            None
        };
        LoadReport {
            spec: Some(s.spec),
            state,
            elapsed_ms: u64::try_from(elapsed.as_millis()).unwrap_or(u64::MAX),
            progress: s.progress.load(Ordering::Relaxed),
            exit_code,
            oom_kills: ooms,
            guest_mem_total_mib: total,
            error,
        }
    }

    /// Kills every running load (before shutdown) and waits up to `wait` for them to end.
    pub fn stop_all(&self, wait: Duration) {
        self.stopping.store(true, Ordering::Relaxed);
        let running: Vec<u32> = {
            let slots = self.slots.lock().unwrap_or_else(|p| p.into_inner());
            slots
                .values()
                .filter(|s| s.end.is_none())
                .map(|s| s.pid)
                .collect()
        };
        for pid in &running {
            let _ = kill(Pid::from_raw(*pid as i32), Signal::SIGKILL);
        }
        let deadline = Instant::now() + wait;
        while Instant::now() < deadline {
            let slots = self.slots.lock().unwrap_or_else(|p| p.into_inner());
            if slots.values().all(|s| s.end.is_some()) {
                return;
            }
            drop(slots);
            std::thread::sleep(Duration::from_millis(20));
        }
    }
}

/// How an exit code reads: 0 finished, a signal killed (unless the agent stopped it), else
/// failed.
pub fn classify(code: i32, stopped_by_agent: bool) -> LoadState {
    match code {
        0 => LoadState::Finished,
        c if c > 128 && !stopped_by_agent => LoadState::Killed,
        c if c > 128 => LoadState::TimedOut,
        _ => LoadState::Failed,
    }
}

/// Why the worker stopped.
#[derive(Debug, thiserror::Error)]
pub enum WorkerError {
    /// Bad arguments.
    #[error(
        "usage: tenantvm-agent load-worker memory|cpu|disk|gpu-memory|gpu-compute AMOUNT SECONDS DIR ({0})"
    )]
    Usage(String),
    /// The CUDA driver is absent or failed (GPU memory load).
    #[error("{0}")]
    Cuda(#[from] crate::cuda::CudaError),
    /// An I/O error (disk load).
    #[error("{what}: {source}")]
    Io {
        /// What failed.
        what: &'static str,
        /// Cause.
        source: std::io::Error,
    },
}

fn progress(out: &mut impl Write, n: u64) {
    let _ = writeln!(out, "progress {n}");
    let _ = out.flush();
}

/// The worker's body: parses `args` (after [`WORKER_ARG`]), runs the load, reports
/// progress on stdout. Caps are checked again here.
pub fn run_worker(args: &[String]) -> Result<(), WorkerError> {
    let [kind, amount, seconds, dir] = args else {
        return Err(WorkerError::Usage(format!("{} arguments", args.len())));
    };
    let kind = LoadKind::parse(kind).ok_or_else(|| WorkerError::Usage(kind.clone()))?;
    let spec = LoadSpec {
        kind,
        amount: amount
            .parse()
            .map_err(|_| WorkerError::Usage(amount.clone()))?,
        seconds: seconds
            .parse()
            .map_err(|_| WorkerError::Usage(seconds.clone()))?,
    };
    spec.check()
        .map_err(|e| WorkerError::Usage(e.to_string()))?;
    // The OOM killer's first choice: never the agent's payload.
    let _ = std::fs::write("/proc/self/oom_score_adj", "1000");
    let wall = Duration::from_secs(u64::from(spec.seconds));
    let mut out = std::io::stdout().lock();
    match kind {
        LoadKind::Memory => memory(&mut out, spec.amount, wall),
        LoadKind::Cpu => cpu(&mut out, spec.amount, wall),
        LoadKind::Disk => disk(&mut out, Path::new(dir), spec.amount, wall),
        LoadKind::GpuMemory => gpu_memory(&mut out, crate::cuda::CUDA_LIBRARY, spec.amount, wall),
        LoadKind::GpuCompute => gpu_compute(&mut out, crate::cuda::CUDA_LIBRARY, spec.amount, wall),
    }
}

/// The GPU memory load: device 0 of `library`'s driver, filled up to `mib` MiB or until out
/// of memory; progress in MiB allocated; held for `hold`, then freed.
pub fn gpu_memory(
    out: &mut impl Write,
    library: &str,
    mib: u32,
    hold: Duration,
) -> Result<(), WorkerError> {
    let cuda = crate::cuda::Cuda::open(library)?;
    let mut ctx = cuda.context(0)?;
    let held = crate::cuda::fill(&mut ctx, u64::from(mib) << 20, |b| progress(out, b >> 20))?;
    progress(out, held >> 20);
    std::thread::sleep(hold);
    ctx.free_all();
    Ok(())
}

/// The GPU compute load: device 0 of `library`'s driver kept busy with `blocks` blocks per
/// launch for `wall`; progress in millions of multiply-adds done.
pub fn gpu_compute(
    out: &mut impl Write,
    library: &str,
    blocks: u32,
    wall: Duration,
) -> Result<(), WorkerError> {
    crate::cuda_compute::spin(library, blocks, wall, |m| progress(out, m))?;
    Ok(())
}

fn memory(out: &mut impl Write, mib: u32, hold: Duration) -> Result<(), WorkerError> {
    let mut held: Vec<Vec<u8>> = Vec::with_capacity(mib as usize);
    for i in 1..=u64::from(mib) {
        // `resize` writes every byte: the pages are really taken, not just reserved.
        let mut chunk = Vec::new();
        chunk.resize(1 << 20, (i as u8) | 1);
        held.push(chunk);
        if i % 8 == 0 || i == u64::from(mib) {
            progress(out, i);
        }
    }
    std::thread::sleep(hold);
    drop(held);
    Ok(())
}

fn cpu(out: &mut impl Write, threads: u32, wall: Duration) -> Result<(), WorkerError> {
    let deadline = Instant::now() + wall;
    let rounds = Arc::new(AtomicU64::new(0));
    std::thread::scope(|s| {
        for _ in 0..threads {
            let rounds = Arc::clone(&rounds);
            s.spawn(move || {
                let mut x: u64 = 0x9e37_79b9_7f4a_7c15;
                while Instant::now() < deadline {
                    for _ in 0..100_000 {
                        x = x.rotate_left(7) ^ x.wrapping_mul(0x2545_f491_4f6c_dd1d);
                    }
                    std::hint::black_box(x);
                    rounds.fetch_add(1, Ordering::Relaxed);
                }
            });
        }
        while Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(250));
            // Rounds of 100,000 steps: progress counts millions of steps.
            progress(out, rounds.load(Ordering::Relaxed) / 10);
        }
    });
    progress(out, rounds.load(Ordering::Relaxed) / 10);
    Ok(())
}

fn disk(out: &mut impl Write, dir: &Path, mib: u32, wall: Duration) -> Result<(), WorkerError> {
    let path = dir.join(DISK_LOAD_FILE);
    let io = |what| move |source| WorkerError::Io { what, source };
    let mut f = std::fs::OpenOptions::new()
        .create(true)
        .truncate(true)
        .write(true)
        .open(&path)
        .map_err(io("create the load file"))?;
    let mut block = vec![0u8; 1 << 20];
    let mut x: u64 = 0x9e37_79b9_7f4a_7c15;
    let deadline = Instant::now() + wall;
    let mut written: u64 = 0;
    let result = (|| {
        while Instant::now() < deadline {
            for i in 0..u64::from(mib) {
                if Instant::now() >= deadline {
                    break;
                }
                for b in block.chunks_exact_mut(8) {
                    x ^= x << 13;
                    x ^= x >> 7;
                    x ^= x << 17;
                    b.copy_from_slice(&x.to_le_bytes());
                }
                f.write_all(&block).map_err(io("write the load file"))?;
                written += 1;
                if i % 4 == 3 {
                    f.sync_data().map_err(io("fsync the load file"))?;
                    progress(out, written);
                }
            }
            f.sync_data().map_err(io("fsync the load file"))?;
            f.seek(SeekFrom::Start(0))
                .map_err(io("rewind the load file"))?;
        }
        progress(out, written);
        Ok(())
    })();
    let _ = std::fs::remove_file(&path);
    result
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn exit_codes_classify() {
        assert_eq!(classify(0, false), LoadState::Finished);
        assert_eq!(classify(137, false), LoadState::Killed);
        assert_eq!(classify(137, true), LoadState::TimedOut);
        assert_eq!(classify(1, false), LoadState::Failed);
    }

    #[test]
    fn worker_refuses_bad_arguments() {
        let s = |v: &[&str]| v.iter().map(|a| a.to_string()).collect::<Vec<_>>();
        for bad in [
            s(&["memory", "1", "1"]),
            s(&["gpu", "1", "1", "/"]),
            s(&["memory", "x", "1", "/"]),
            s(&["memory", "1", "0", "/"]),
            s(&["cpu", "65", "1", "/"]),
            s(&["disk", "2000", "1", "/"]),
        ] {
            assert!(
                matches!(run_worker(&bad), Err(WorkerError::Usage(_))),
                "{bad:?}"
            );
        }
    }

    #[test]
    fn disk_worker_writes_fsyncs_and_removes_its_file() {
        let dir = tempfile::tempdir().unwrap();
        let mut out = Vec::new();
        disk(&mut out, dir.path(), 4, Duration::from_millis(300)).unwrap();
        let text = String::from_utf8(out).unwrap();
        let last: u64 = text
            .lines()
            .last()
            .and_then(|l| l.strip_prefix("progress "))
            .unwrap()
            .parse()
            .unwrap();
        assert!(last >= 4, "{text}");
        assert!(!dir.path().join(DISK_LOAD_FILE).exists());
    }

    #[test]
    fn memory_and_cpu_workers_report_progress() {
        let mut out = Vec::new();
        memory(&mut out, 16, Duration::from_millis(10)).unwrap();
        assert!(String::from_utf8_lossy(&out).ends_with("progress 16\n"));
        let mut out = Vec::new();
        cpu(&mut out, 1, Duration::from_millis(300)).unwrap();
        assert!(String::from_utf8_lossy(&out).starts_with("progress "));
    }

    #[test]
    fn disk_load_needs_a_mounted_disk_and_one_of_a_kind_runs() {
        let loads = Loads::default();
        let reaper = Reaper::start().unwrap();
        let spec = LoadSpec {
            kind: LoadKind::Disk,
            amount: 4,
            seconds: 1,
        };
        assert!(matches!(
            loads.start(&reaper, spec, None),
            Err(LoadError::NotMounted)
        ));
        let huge = LoadSpec {
            amount: 1024,
            ..spec
        };
        let dir = tempfile::tempdir().unwrap();
        // A temp dir rarely has 2 GiB free in CI; when it has, the cap still refuses 0.
        if free_mib(dir.path()) < 2048 {
            assert!(matches!(
                loads.start(&reaper, huge, Some(dir.path())),
                Err(LoadError::NoSpace { .. })
            ));
        }
        assert!(matches!(
            loads.start(&reaper, LoadSpec { amount: 0, ..spec }, Some(dir.path())),
            Err(LoadError::Spec(_))
        ));
        assert_eq!(loads.report(LoadKind::Cpu).state, LoadState::Idle);
    }
}
