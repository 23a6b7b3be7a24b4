//! Per-tenant log files: `serial.log` (the guest's console), `vmm.log` (the VMM's and the
//! jail launcher's stderr) and `events.log` (lifecycle events written by the daemon), in the
//! tenant's directory (mode 0700; files 0600).
//!
//! Files are size-capped and rotated copy-then-truncate (`serial.log` -> `serial.log.1` ->
//! ... -> `serial.log.N`), which keeps working while the VMM holds its `O_APPEND` fd: after
//! the truncation its next write lands at offset 0. Each rotation bumps a generation number
//! kept in `<name>.gen` next to the file, so a follower's [`LogCursor`] survives rotations
//! and daemon restarts. Guest output is hostile: readers replace control characters so it
//! cannot drive the reader's terminal.
//!
//! A tenant's logs are only reachable through [`TenantLogs::open`], which derives the
//! directory from a validated tenant name.

use std::fs::{self, File, OpenOptions};
use std::io::{ErrorKind, Read, Seek, SeekFrom, Write};
use std::os::unix::fs::{DirBuilderExt, OpenOptionsExt, PermissionsExt};
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use crate::jail::validate_tenant_name;

/// Default cap of one log file before it is rotated (8 MiB).
pub const DEFAULT_MAX_BYTES: u64 = 8 << 20;
/// Default number of rotated files kept per log.
pub const DEFAULT_KEEP: u32 = 3;
/// The most lines [`TenantLogs::tail`] returns.
pub const MAX_TAIL_LINES: usize = 10_000;
/// The most bytes [`TenantLogs::read_from`] returns at once.
pub const MAX_CHUNK_BYTES: usize = 1 << 20;

/// Errors of log operations.
#[derive(Debug, thiserror::Error)]
pub enum LogError {
    /// The tenant name cannot be used in a path.
    #[error("Invalid tenant name {0:?}: use 1 to 63 of a-z, 0-9 and '-', starting with a letter or digit")]
    InvalidTenant(String),
    /// The request cannot be served as asked.
    #[error("Invalid log request: {0}")]
    InvalidRequest(String),
    /// A log file or directory could not be accessed.
    #[error("Cannot access {path}")]
    Io {
        /// The path.
        path: PathBuf,
        /// The cause.
        #[source]
        source: std::io::Error,
    },
}

/// Which of a tenant's logs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum LogKind {
    /// The guest's serial console.
    Serial,
    /// The VMM's own log (its stderr and the jail launcher's).
    Vmm,
    /// Lifecycle events recorded by the daemon.
    Events,
}

impl LogKind {
    /// Every kind.
    pub const ALL: [LogKind; 3] = [LogKind::Serial, LogKind::Vmm, LogKind::Events];

    /// The file name in the tenant directory.
    pub fn file_name(self) -> &'static str {
        match self {
            LogKind::Serial => "serial.log",
            LogKind::Vmm => "vmm.log",
            LogKind::Events => "events.log",
        }
    }
}

/// Size cap and rotation depth.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct LogPolicy {
    /// A file is rotated once it reaches this many bytes.
    pub max_bytes: u64,
    /// How many rotated files are kept (`.1` is the newest).
    pub keep: u32,
}

impl Default for LogPolicy {
    fn default() -> Self {
        Self {
            max_bytes: DEFAULT_MAX_BYTES,
            keep: DEFAULT_KEEP,
        }
    }
}

/// Where a follower is: a rotation generation and a byte offset in the live file of that
/// generation. Start with `LogCursor::default()` (the beginning) or [`TenantLogs::end`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct LogCursor {
    /// Rotation generation of the live file.
    pub generation: u64,
    /// Byte offset in it.
    pub offset: u64,
}

/// What [`TenantLogs::read_from`] returns: complete lines (sanitised) and where to go on.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct LogChunk {
    /// Text read, whole lines only (a line longer than the chunk limit is split).
    pub text: String,
    /// Pass this to the next call.
    pub next: LogCursor,
    /// True when output was lost to rotation between the calls (the follower fell behind
    /// by more than one rotation).
    pub skipped: bool,
}

/// One tenant's log files.
#[derive(Debug, Clone)]
pub struct TenantLogs {
    dir: PathBuf,
    policy: LogPolicy,
}

impl TenantLogs {
    /// Opens the logs of `tenant` in `tenants_root/<tenant>`, creating the directory (0700)
    /// and the files (0600) when missing. The name is validated here, so no request can reach
    /// another path.
    pub fn open(tenants_root: &Path, tenant: &str, policy: LogPolicy) -> Result<Self, LogError> {
        validate_tenant_name(tenant).map_err(|_| LogError::InvalidTenant(tenant.to_string()))?;
        if policy.max_bytes < 4096 || policy.keep == 0 || policy.keep > 100 {
            return Err(LogError::InvalidRequest(format!(
                "log policy needs max_bytes >= 4096 and keep in 1..=100 (got {} and {})",
                policy.max_bytes, policy.keep
            )));
        }
        let dir = tenants_root.join(tenant);
        match fs::DirBuilder::new().mode(0o700).create(&dir) {
            Ok(()) => {}
            Err(e) if e.kind() == ErrorKind::AlreadyExists => {}
            Err(source) => return Err(LogError::Io { path: dir, source }),
        }
        fs::set_permissions(&dir, fs::Permissions::from_mode(0o700)).map_err(|source| {
            LogError::Io {
                path: dir.clone(),
                source,
            }
        })?;
        let logs = Self { dir, policy };
        for kind in LogKind::ALL {
            drop(logs.open_append(kind)?);
        }
        Ok(logs)
    }

    /// The logs of `tenant` if its directory exists, creating nothing (for housekeeping,
    /// which must never recreate what a departure is removing).
    pub fn existing(
        tenants_root: &Path,
        tenant: &str,
        policy: LogPolicy,
    ) -> Result<Option<Self>, LogError> {
        validate_tenant_name(tenant).map_err(|_| LogError::InvalidTenant(tenant.to_string()))?;
        let dir = tenants_root.join(tenant);
        match fs::symlink_metadata(&dir) {
            Ok(meta) if meta.is_dir() => Ok(Some(Self { dir, policy })),
            Ok(_) => Ok(None),
            Err(e) if e.kind() == ErrorKind::NotFound => Ok(None),
            Err(source) => Err(LogError::Io { path: dir, source }),
        }
    }

    /// The tenant directory.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// The live file of `kind`.
    pub fn path(&self, kind: LogKind) -> PathBuf {
        self.dir.join(kind.file_name())
    }

    fn rotated_path(&self, kind: LogKind, n: u32) -> PathBuf {
        self.dir.join(format!("{}.{n}", kind.file_name()))
    }

    fn generation_path(&self, kind: LogKind) -> PathBuf {
        self.dir.join(format!("{}.gen", kind.file_name()))
    }

    /// Opens the live file of `kind` for appending (0600, no symlinks followed): the fd to
    /// hand to the VMM's stderr or to write events through.
    pub fn open_append(&self, kind: LogKind) -> Result<File, LogError> {
        let path = self.path(kind);
        OpenOptions::new()
            .append(true)
            .create(true)
            .mode(0o600)
            .custom_flags(libc::O_NOFOLLOW | libc::O_CLOEXEC)
            .open(&path)
            .map_err(|source| LogError::Io { path, source })
    }

    /// Appends one event line, rotating first if needed. The line is bounded and its control
    /// characters (newlines included) escaped ([`crate::untrusted::GuestLine`]): events
    /// quote guests, and one event is always one line.
    pub fn append_event(&self, line: &str) -> Result<(), LogError> {
        self.rotate_if_needed(LogKind::Events)?;
        let mut clean = crate::untrusted::one_line(line);
        clean.push('\n');
        let mut file = self.open_append(LogKind::Events)?;
        file.write_all(clean.as_bytes())
            .map_err(|source| LogError::Io {
                path: self.path(LogKind::Events),
                source,
            })
    }

    /// The current rotation generation of `kind` (0 before the first rotation).
    pub fn generation(&self, kind: LogKind) -> Result<u64, LogError> {
        let path = self.generation_path(kind);
        match fs::read_to_string(&path) {
            Ok(text) => text.trim().parse().map_err(|_| LogError::Io {
                path,
                source: std::io::Error::new(ErrorKind::InvalidData, "corrupt generation file"),
            }),
            Err(e) if e.kind() == ErrorKind::NotFound => Ok(0),
            Err(source) => Err(LogError::Io { path, source }),
        }
    }

    fn set_generation(&self, kind: LogKind, generation: u64) -> Result<(), LogError> {
        let path = self.generation_path(kind);
        let tmp = self.dir.join(format!("{}.gen.tmp", kind.file_name()));
        let write = || -> std::io::Result<()> {
            let mut f = OpenOptions::new()
                .write(true)
                .create(true)
                .truncate(true)
                .mode(0o600)
                .custom_flags(libc::O_NOFOLLOW)
                .open(&tmp)?;
            f.write_all(generation.to_string().as_bytes())?;
            f.sync_all()?;
            fs::rename(&tmp, &path)
        };
        write().map_err(|source| LogError::Io { path, source })
    }

    /// Rotates `kind` if its live file reached the cap. Returns whether it rotated.
    pub fn rotate_if_needed(&self, kind: LogKind) -> Result<bool, LogError> {
        let path = self.path(kind);
        let len = match fs::symlink_metadata(&path) {
            Ok(meta) => meta.len(),
            Err(e) if e.kind() == ErrorKind::NotFound => return Ok(false),
            Err(source) => return Err(LogError::Io { path, source }),
        };
        if len < self.policy.max_bytes {
            return Ok(false);
        }
        self.rotate(kind)?;
        Ok(true)
    }

    /// Checks every log against the cap (the daemon calls this periodically, since the VMM
    /// writes serial.log and vmm.log on its own).
    pub fn enforce_caps(&self) -> Result<(), LogError> {
        for kind in LogKind::ALL {
            self.rotate_if_needed(kind)?;
        }
        Ok(())
    }

    /// Empties every live log over its cap in place, creating nothing (no rotated copy):
    /// for a tenant whose departure may remove its files at any moment (a departure stops
    /// the VM first, and a guest keeps writing its console until then). What is cut is
    /// about to be destroyed anyway. Returns the logs emptied.
    pub fn truncate_over_caps(&self) -> Result<Vec<LogKind>, LogError> {
        let mut emptied = Vec::new();
        for kind in LogKind::ALL {
            let path = self.path(kind);
            // Opened without create and without following a link: a file the departure
            // removed is not made again.
            let file = match OpenOptions::new()
                .write(true)
                .custom_flags(libc::O_NOFOLLOW)
                .open(&path)
            {
                Ok(f) => f,
                Err(e) if e.kind() == ErrorKind::NotFound => continue,
                Err(source) => return Err(LogError::Io { path, source }),
            };
            let len = file
                .metadata()
                .map_err(|source| LogError::Io {
                    path: path.clone(),
                    source,
                })?
                .len();
            if len >= self.policy.max_bytes {
                file.set_len(0)
                    .map_err(|source| LogError::Io { path, source })?;
                emptied.push(kind);
            }
        }
        Ok(emptied)
    }

    /// Rotates `kind` now: shifts `.1..` up (dropping the oldest), copies the live file to
    /// `.1`, truncates the live file in place, and bumps the generation.
    pub fn rotate(&self, kind: LogKind) -> Result<(), LogError> {
        let io = |path: &Path| {
            let path = path.to_path_buf();
            move |source| LogError::Io { path, source }
        };
        let oldest = self.rotated_path(kind, self.policy.keep);
        match fs::remove_file(&oldest) {
            Ok(()) => {}
            Err(e) if e.kind() == ErrorKind::NotFound => {}
            Err(source) => {
                return Err(LogError::Io {
                    path: oldest,
                    source,
                })
            }
        }
        for n in (1..self.policy.keep).rev() {
            let from = self.rotated_path(kind, n);
            match fs::rename(&from, self.rotated_path(kind, n + 1)) {
                Ok(()) => {}
                Err(e) if e.kind() == ErrorKind::NotFound => {}
                Err(source) => return Err(LogError::Io { path: from, source }),
            }
        }
        let live_path = self.path(kind);
        let mut live = OpenOptions::new()
            .read(true)
            .write(true)
            .custom_flags(libc::O_NOFOLLOW)
            .open(&live_path)
            .map_err(io(&live_path))?;
        let first = self.rotated_path(kind, 1);
        let mut copy = OpenOptions::new()
            .write(true)
            .create_new(true)
            .mode(0o600)
            .custom_flags(libc::O_NOFOLLOW)
            .open(&first)
            .map_err(io(&first))?;
        // Copy, then copy again what the writer appended meanwhile, so the window between
        // the last copy and the truncation (the only bytes that can be lost) stays tiny.
        loop {
            let copied = std::io::copy(&mut live, &mut copy).map_err(io(&first))?;
            if copied == 0 {
                break;
            }
        }
        live.set_len(0).map_err(io(&live_path))?;
        let generation = self.generation(kind)?;
        self.set_generation(kind, generation + 1)
    }

    /// A cursor at the current end of `kind` (to follow only new output).
    pub fn end(&self, kind: LogKind) -> Result<LogCursor, LogError> {
        let path = self.path(kind);
        let len = fs::metadata(&path)
            .map_err(|source| LogError::Io { path, source })?
            .len();
        Ok(LogCursor {
            generation: self.generation(kind)?,
            offset: len,
        })
    }

    /// The last `lines` lines of `kind` (reaching into `.1`, `.2`, ... when the live file has
    /// fewer),
    /// sanitised, oldest first.
    pub fn tail(&self, kind: LogKind, lines: usize) -> Result<Vec<String>, LogError> {
        if lines > MAX_TAIL_LINES {
            return Err(LogError::InvalidRequest(format!(
                "at most {MAX_TAIL_LINES} lines can be read at once (asked for {lines})"
            )));
        }
        let mut out = tail_file(&self.path(kind), lines)?;
        for n in 1..=self.policy.keep {
            if out.len() >= lines {
                break;
            }
            let mut older = tail_file(&self.rotated_path(kind, n), lines - out.len())?;
            older.append(&mut out);
            out = older;
        }
        Ok(out)
    }

    /// Reads what was written after `cursor`, at most `max_bytes` (up to
    /// [`MAX_CHUNK_BYTES`]), as whole sanitised lines. Follows across rotations: a cursor
    /// one generation behind first gets the rest of `.1`.
    pub fn read_from(
        &self,
        kind: LogKind,
        cursor: LogCursor,
        max_bytes: usize,
    ) -> Result<LogChunk, LogError> {
        if max_bytes == 0 || max_bytes > MAX_CHUNK_BYTES {
            return Err(LogError::InvalidRequest(format!(
                "max_bytes must be in 1..={MAX_CHUNK_BYTES} (got {max_bytes})"
            )));
        }
        let generation = self.generation(kind)?;
        if cursor.generation > generation {
            return Err(LogError::InvalidRequest(format!(
                "cursor generation {} is ahead of the log's ({generation}); start again from the beginning or the end",
                cursor.generation
            )));
        }
        if cursor.generation + 1 == generation {
            // The rest of the previous generation, now in .1.
            let (text, advanced) =
                read_lines(&self.rotated_path(kind, 1), cursor.offset, max_bytes)?;
            if advanced > 0 {
                return Ok(LogChunk {
                    text,
                    next: LogCursor {
                        generation: cursor.generation,
                        offset: cursor.offset + advanced,
                    },
                    skipped: false,
                });
            }
            let (text, advanced) = read_lines(&self.path(kind), 0, max_bytes)?;
            return Ok(LogChunk {
                text,
                next: LogCursor {
                    generation,
                    offset: advanced,
                },
                skipped: false,
            });
        }
        let skipped = cursor.generation != generation;
        let mut offset = if skipped { 0 } else { cursor.offset };
        let live_len = fs::metadata(self.path(kind)).map_or(0, |m| m.len());
        let mut skipped = skipped;
        if offset > live_len {
            // Truncated under us without a recorded rotation (e.g. by the writer itself).
            offset = 0;
            skipped = true;
        }
        let (text, advanced) = read_lines(&self.path(kind), offset, max_bytes)?;
        Ok(LogChunk {
            text,
            next: LogCursor {
                generation,
                offset: offset + advanced,
            },
            skipped,
        })
    }

    /// Removes every log file of the tenant (live, rotated, generation files). The
    /// directory itself stays (the control plane removes it). Idempotent.
    pub fn remove_all(&self) -> Result<(), LogError> {
        for kind in LogKind::ALL {
            let mut paths = vec![self.path(kind), self.generation_path(kind)];
            paths.extend((1..=self.policy.keep.max(100)).map(|n| self.rotated_path(kind, n)));
            for path in paths {
                match fs::remove_file(&path) {
                    Ok(()) => {}
                    Err(e) if e.kind() == ErrorKind::NotFound => {}
                    Err(source) => return Err(LogError::Io { path, source }),
                }
            }
        }
        Ok(())
    }
}

/// Replaces control characters (other than newline and tab) that could drive a terminal:
/// [`crate::untrusted::multi_line`].
pub fn sanitize(text: &str) -> String {
    crate::untrusted::multi_line(text)
}

fn open_read(path: &Path) -> Result<Option<File>, LogError> {
    match OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NOFOLLOW)
        .open(path)
    {
        Ok(f) => Ok(Some(f)),
        Err(e) if e.kind() == ErrorKind::NotFound => Ok(None),
        Err(source) => Err(LogError::Io {
            path: path.to_path_buf(),
            source,
        }),
    }
}

/// The last `lines` lines of a file, reading backwards in blocks.
fn tail_file(path: &Path, lines: usize) -> Result<Vec<String>, LogError> {
    if lines == 0 {
        return Ok(Vec::new());
    }
    let Some(mut file) = open_read(path)? else {
        return Ok(Vec::new());
    };
    let io = |source| LogError::Io {
        path: path.to_path_buf(),
        source,
    };
    let len = file.metadata().map_err(io)?.len();
    let mut start = len;
    let mut buf: Vec<u8> = Vec::new();
    const BLOCK: u64 = 64 * 1024;
    loop {
        let newlines = buf.iter().filter(|b| **b == b'\n').count();
        // One more newline than lines wanted marks the start of the first wanted line
        // (the file's last byte is usually a newline too).
        if newlines > lines || start == 0 {
            break;
        }
        let step = BLOCK.min(start);
        start -= step;
        file.seek(SeekFrom::Start(start)).map_err(io)?;
        let mut block = vec![0u8; usize::try_from(step).unwrap_or(0)];
        file.read_exact(&mut block).map_err(io)?;
        block.extend_from_slice(&buf);
        buf = block;
    }
    let text = String::from_utf8_lossy(&buf);
    let all: Vec<&str> = text.split_terminator('\n').collect();
    let mut out: Vec<String> = all
        .iter()
        .rev()
        .take(lines)
        .rev()
        .map(|l| sanitize(l))
        .collect();
    if start > 0 && all.len() <= lines {
        // The first piece is a partial line cut by the block boundary.
        out.remove(0);
    }
    Ok(out)
}

/// Reads whole lines from `offset`, at most `max_bytes`; returns the text and how many
/// bytes of the file it covers.
fn read_lines(path: &Path, offset: u64, max_bytes: usize) -> Result<(String, u64), LogError> {
    let Some(mut file) = open_read(path)? else {
        return Ok((String::new(), 0));
    };
    let io = |source| LogError::Io {
        path: path.to_path_buf(),
        source,
    };
    file.seek(SeekFrom::Start(offset)).map_err(io)?;
    let mut buf = Vec::with_capacity(max_bytes.min(64 * 1024));
    file.take(max_bytes as u64)
        .read_to_end(&mut buf)
        .map_err(io)?;
    let used = match buf.iter().rposition(|b| *b == b'\n') {
        Some(pos) => pos + 1,
        // A line longer than the chunk: hand it over in pieces.
        None if buf.len() == max_bytes => buf.len(),
        None => 0,
    };
    buf.truncate(used);
    Ok((sanitize(&String::from_utf8_lossy(&buf)), used as u64))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn logs(max_bytes: u64) -> (tempfile::TempDir, TenantLogs) {
        let root = tempfile::tempdir().unwrap();
        let logs =
            TenantLogs::open(root.path(), "alpha", LogPolicy { max_bytes, keep: 3 }).unwrap();
        (root, logs)
    }

    #[test]
    fn open_creates_private_dir_and_files() {
        let (_root, logs) = logs(4096);
        assert_eq!(
            fs::metadata(logs.dir()).unwrap().permissions().mode() & 0o777,
            0o700
        );
        for kind in LogKind::ALL {
            assert_eq!(
                fs::metadata(logs.path(kind)).unwrap().permissions().mode() & 0o777,
                0o600
            );
        }
    }

    #[test]
    fn open_rejects_path_like_tenant_names() {
        let root = tempfile::tempdir().unwrap();
        for bad in ["../etc", "a/b", "", ".", "UPPER", "-lead", &"x".repeat(64)] {
            let err = TenantLogs::open(root.path(), bad, LogPolicy::default()).unwrap_err();
            assert!(matches!(err, LogError::InvalidTenant(_)), "{bad}: {err}");
        }
    }

    #[test]
    fn open_rejects_bad_policy() {
        let root = tempfile::tempdir().unwrap();
        let err = TenantLogs::open(
            root.path(),
            "a",
            LogPolicy {
                max_bytes: 10,
                keep: 3,
            },
        )
        .unwrap_err();
        assert!(matches!(err, LogError::InvalidRequest(_)));
        let err = TenantLogs::open(
            root.path(),
            "a",
            LogPolicy {
                max_bytes: 8192,
                keep: 0,
            },
        )
        .unwrap_err();
        assert!(matches!(err, LogError::InvalidRequest(_)));
    }

    #[test]
    fn tail_returns_last_lines_in_order() {
        let (_root, logs) = logs(1 << 20);
        for i in 0..100 {
            logs.append_event(&format!("event {i}")).unwrap();
        }
        assert_eq!(
            logs.tail(LogKind::Events, 3).unwrap(),
            vec!["event 97", "event 98", "event 99"]
        );
        assert_eq!(logs.tail(LogKind::Events, 0).unwrap(), Vec::<String>::new());
        assert_eq!(logs.tail(LogKind::Events, 500).unwrap().len(), 100);
    }

    #[test]
    fn tail_spans_block_boundaries() {
        let (_root, logs) = logs(1 << 22);
        let long = "y".repeat(1000);
        for i in 0..200 {
            logs.append_event(&format!("{i} {long}")).unwrap();
        }
        let got = logs.tail(LogKind::Events, 150).unwrap();
        assert_eq!(got.len(), 150);
        assert!(got[0].starts_with("50 "));
        assert!(got[149].starts_with("199 "));
    }

    #[test]
    fn tail_rejects_huge_requests() {
        let (_root, logs) = logs(4096);
        assert!(matches!(
            logs.tail(LogKind::Serial, MAX_TAIL_LINES + 1),
            Err(LogError::InvalidRequest(_))
        ));
    }

    #[test]
    fn rotation_caps_size_and_keeps_configured_depth() {
        let (_root, logs) = logs(4096);
        for i in 0..2000 {
            logs.append_event(&format!("line {i:05} padding padding"))
                .unwrap();
        }
        assert!(fs::metadata(logs.path(LogKind::Events)).unwrap().len() < 4096 + 64);
        assert!(logs.rotated_path(LogKind::Events, 3).exists());
        assert!(!logs.rotated_path(LogKind::Events, 4).exists());
        assert!(logs.generation(LogKind::Events).unwrap() > 3);
        // Newest lines survive, in order, across the live file and .1.
        let tail = logs.tail(LogKind::Events, 200).unwrap();
        assert_eq!(tail.last().unwrap(), "line 01999 padding padding");
        assert_eq!(tail.len(), 200);
    }

    #[test]
    fn rotation_keeps_append_writer_working() {
        // The VMM keeps an O_APPEND fd across rotations: after truncation its writes must
        // land at the start of the live file, not leave a hole.
        let (_root, logs) = logs(4096);
        let mut writer = logs.open_append(LogKind::Serial).unwrap();
        writer.write_all(&vec![b'a'; 5000]).unwrap();
        writer.write_all(b"\n").unwrap();
        assert!(logs.rotate_if_needed(LogKind::Serial).unwrap());
        writer.write_all(b"after rotation\n").unwrap();
        assert_eq!(
            fs::read(logs.path(LogKind::Serial)).unwrap(),
            b"after rotation\n"
        );
        assert_eq!(
            fs::metadata(logs.rotated_path(LogKind::Serial, 1))
                .unwrap()
                .len(),
            5001
        );
    }

    #[test]
    fn follow_continues_across_a_rotation() {
        let (_root, logs) = logs(4096);
        let mut writer = logs.open_append(LogKind::Serial).unwrap();
        writer.write_all(b"one\ntwo\n").unwrap();
        let first = logs
            .read_from(LogKind::Serial, LogCursor::default(), 1024)
            .unwrap();
        assert_eq!(first.text, "one\ntwo\n");
        writer.write_all(b"three\n").unwrap();
        logs.rotate(LogKind::Serial).unwrap();
        writer.write_all(b"four\n").unwrap();
        let second = logs.read_from(LogKind::Serial, first.next, 1024).unwrap();
        assert_eq!(second.text, "three\n");
        let third = logs.read_from(LogKind::Serial, second.next, 1024).unwrap();
        assert_eq!(third.text, "four\n");
        assert!(!third.skipped);
        let idle = logs.read_from(LogKind::Serial, third.next, 1024).unwrap();
        assert_eq!(idle.text, "");
        assert_eq!(idle.next, third.next);
    }

    #[test]
    fn follow_holds_back_partial_lines() {
        let (_root, logs) = logs(4096);
        let mut writer = logs.open_append(LogKind::Serial).unwrap();
        writer.write_all(b"whole\npart").unwrap();
        let chunk = logs
            .read_from(LogKind::Serial, LogCursor::default(), 1024)
            .unwrap();
        assert_eq!(chunk.text, "whole\n");
        writer.write_all(b"ial\n").unwrap();
        assert_eq!(
            logs.read_from(LogKind::Serial, chunk.next, 1024)
                .unwrap()
                .text,
            "partial\n"
        );
    }

    #[test]
    fn follow_reports_skipped_output_after_several_rotations() {
        let (_root, logs) = logs(4096);
        let mut writer = logs.open_append(LogKind::Serial).unwrap();
        writer.write_all(b"old\n").unwrap();
        logs.rotate(LogKind::Serial).unwrap();
        logs.rotate(LogKind::Serial).unwrap();
        writer.write_all(b"new\n").unwrap();
        let chunk = logs
            .read_from(LogKind::Serial, LogCursor::default(), 1024)
            .unwrap();
        assert!(chunk.skipped);
        assert_eq!(chunk.text, "new\n");
    }

    #[test]
    fn follow_rejects_cursor_from_the_future_and_bad_sizes() {
        let (_root, logs) = logs(4096);
        let future = LogCursor {
            generation: 9,
            offset: 0,
        };
        assert!(matches!(
            logs.read_from(LogKind::Serial, future, 10),
            Err(LogError::InvalidRequest(_))
        ));
        assert!(matches!(
            logs.read_from(LogKind::Serial, LogCursor::default(), 0),
            Err(LogError::InvalidRequest(_))
        ));
    }

    #[test]
    fn follow_survives_a_reopen_like_a_daemon_restart() {
        let root = tempfile::tempdir().unwrap();
        let policy = LogPolicy {
            max_bytes: 4096,
            keep: 2,
        };
        let logs = TenantLogs::open(root.path(), "t1", policy).unwrap();
        logs.append_event("a").unwrap();
        logs.rotate(LogKind::Events).unwrap();
        let cursor = logs.end(LogKind::Events).unwrap();
        drop(logs);
        let logs = TenantLogs::open(root.path(), "t1", policy).unwrap();
        logs.append_event("b").unwrap();
        let chunk = logs.read_from(LogKind::Events, cursor, 1024).unwrap();
        assert_eq!(chunk.text, "b\n");
        assert!(!chunk.skipped);
    }

    #[test]
    fn readers_neutralise_terminal_escapes_from_the_guest() {
        let (_root, logs) = logs(4096);
        let mut writer = logs.open_append(LogKind::Serial).unwrap();
        writer.write_all(b"\x1b[2Jevil\x07\tok\xff\n").unwrap();
        let line = &logs.tail(LogKind::Serial, 1).unwrap()[0];
        assert!(!line.contains('\x1b') && !line.contains('\x07'));
        assert!(line.contains("evil") && line.contains("\tok"));
        let chunk = logs
            .read_from(LogKind::Serial, LogCursor::default(), 1024)
            .unwrap();
        assert!(!chunk.text.contains('\x1b'));
    }

    #[test]
    fn events_cannot_inject_lines() {
        let (_root, logs) = logs(4096);
        logs.append_event("one\nfake line\x1b[2K").unwrap();
        assert_eq!(
            logs.tail(LogKind::Events, 5).unwrap(),
            vec!["one\\nfake line\\x1b[2K"]
        );
        logs.append_event(&"x".repeat(1 << 20)).unwrap();
        let last = logs.tail(LogKind::Events, 1).unwrap().remove(0);
        assert!(last.len() <= crate::untrusted::MAX_FIELD_BYTES && last.contains("truncated"));
    }

    #[test]
    fn open_append_refuses_symlinked_log() {
        let (root, logs) = logs(4096);
        let target = root.path().join("elsewhere");
        fs::write(&target, b"secret").unwrap();
        fs::remove_file(logs.path(LogKind::Vmm)).unwrap();
        std::os::unix::fs::symlink(&target, logs.path(LogKind::Vmm)).unwrap();
        logs.open_append(LogKind::Vmm).unwrap_err();
        logs.tail(LogKind::Vmm, 1).unwrap_err();
    }

    #[test]
    fn remove_all_is_idempotent() {
        let (_root, logs) = logs(4096);
        logs.append_event("x").unwrap();
        logs.rotate(LogKind::Events).unwrap();
        logs.remove_all().unwrap();
        logs.remove_all().unwrap();
        assert_eq!(fs::read_dir(logs.dir()).unwrap().count(), 0);
    }
}
