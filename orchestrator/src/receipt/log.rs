//! The audit log: JSON lines, hash-chained, each line signed with the host's ed25519 key, and a
//! signed head file naming the last entry so that a truncated tail is detected too.

use std::fs::{self, File, OpenOptions};
use std::io::{self, Write};
use std::os::fd::AsRawFd;
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};

use ed25519_dalek::{Signature, Signer, SigningKey, VerifyingKey};
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};
use zeroize::Zeroize;

use super::{now_rfc3339, Receipt, ReceiptError};
use crate::keys::{
    create_private_dir, create_private_new, read_private, write_private_atomic, write_public,
};

const ENTRY_DOMAIN: &[u8] = b"tenantvm audit entry v1\n";
const HEAD_DOMAIN: &[u8] = b"tenantvm audit head v1\n";
const GENESIS: &str = "0000000000000000000000000000000000000000000000000000000000000000";
/// Largest line of the audit log, for the writer and every reader alike: [`AuditLog::append`]
/// bounds a receipt until its line fits, and a longer line is reported as damaged.
pub const MAX_LINE: usize = 1 << 20;
/// Room in a line for everything but the receipt (sequence, hashes, key id, signature).
const ENTRY_OVERHEAD: usize = 1024;
/// Infix of the name a damaged log is set aside under: `<log>.damaged-<time>`.
const SET_ASIDE_INFIX: &str = ".damaged-";

/// The host's receipt signing key (ed25519), kept in a 0600 file.
pub struct ReceiptSigner {
    key: SigningKey,
}

impl std::fmt::Debug for ReceiptSigner {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "ReceiptSigner({})", self.key_id())
    }
}

impl ReceiptSigner {
    /// Loads the signing key from `path`, creating it (mode 0600) with a fresh random key if
    /// absent. The public half is (re)written next to it as `<path>.pub`, hex, for verifiers.
    pub fn load_or_create(path: &Path) -> Result<Self, ReceiptError> {
        let io_err = |action, source| ReceiptError::Io {
            action,
            path: path.display().to_string(),
            source,
        };
        let read_key = || -> Result<SigningKey, ReceiptError> {
            let mut bytes = read_private(path, 33)?;
            let seed: Result<[u8; 32], _> = bytes.as_slice().try_into();
            let len = bytes.len();
            bytes.zeroize();
            let mut seed = seed.map_err(|_| ReceiptError::BadKey {
                path: path.display().to_string(),
                what: "signing key",
                reason: format!("{len} bytes, expected 32"),
            })?;
            let key = SigningKey::from_bytes(&seed);
            seed.zeroize();
            Ok(key)
        };
        let key = if fs::symlink_metadata(path).is_ok() {
            read_key()?
        } else {
            use rand::TryRngCore;
            let mut seed = [0u8; 32];
            rand::rngs::OsRng
                .try_fill_bytes(&mut seed)
                .map_err(|e| ReceiptError::Random(e.to_string()))?;
            // Kept if another daemon created one meanwhile: then that one is the key.
            let created = create_private_new(path, &seed);
            let key = SigningKey::from_bytes(&seed);
            seed.zeroize();
            if created.map_err(|e| io_err("write", e))? {
                key
            } else {
                read_key()?
            }
        };
        let signer = ReceiptSigner { key };
        let public = public_key_path(path);
        let text = format!("{}\n", signer.key_id());
        if fs::read_to_string(&public).ok().as_deref() != Some(text.as_str()) {
            write_public(&public, text.as_bytes())
                .map_err(|e| io_err("write the public key next to", e))?;
        }
        Ok(signer)
    }

    /// The public key.
    pub fn verifying_key(&self) -> VerifyingKey {
        self.key.verifying_key()
    }

    /// The public key in hex: the id recorded in each entry.
    pub fn key_id(&self) -> String {
        hex::encode(self.key.verifying_key().as_bytes())
    }
}

/// Where the public half of the signing key at `signing_key` is written.
pub fn public_key_path(signing_key: &Path) -> PathBuf {
    let mut name = signing_key.as_os_str().to_owned();
    name.push(".pub");
    PathBuf::from(name)
}

/// Reads a public key written by [`ReceiptSigner::load_or_create`] (hex, one line).
pub fn load_verifying_key(path: &Path) -> Result<VerifyingKey, ReceiptError> {
    let text = fs::read_to_string(path).map_err(|source| ReceiptError::Io {
        action: "read",
        path: path.display().to_string(),
        source,
    })?;
    let bad = |reason: String| ReceiptError::BadKey {
        path: path.display().to_string(),
        what: "public key",
        reason,
    };
    let bytes = hex::decode(text.trim()).map_err(|e| bad(e.to_string()))?;
    let bytes: [u8; 32] = bytes
        .as_slice()
        .try_into()
        .map_err(|_| bad(format!("{} bytes, expected 32", bytes.len())))?;
    VerifyingKey::from_bytes(&bytes).map_err(|e| bad(e.to_string()))
}

/// One line of the audit log.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct LogEntry {
    /// Position in the log, from 0.
    pub seq: u64,
    /// SHA-256 (hex) of the previous line, or 64 zeroes for the first.
    pub prev_hash: String,
    /// RFC 3339 UTC time of the append.
    pub appended_at: String,
    /// The signing public key (hex).
    pub key_id: String,
    /// The departure receipt.
    pub receipt: Receipt,
    /// ed25519 signature (hex) over the domain tag and the entry without this field.
    pub signature: String,
}

/// The signed part of an entry: everything but the signature, in the same field order.
#[derive(Serialize)]
struct SignedPart<'a> {
    seq: u64,
    prev_hash: &'a str,
    appended_at: &'a str,
    key_id: &'a str,
    receipt: &'a Receipt,
}

impl LogEntry {
    /// Whether `key` signed this entry as it is: a reader that got the entry through the
    /// API rather than the log file (the Kubernetes node agent, before it lets a `Tenant`
    /// go) checks it against the daemon's public key.
    pub fn signed_by(&self, key: &VerifyingKey) -> bool {
        self.signature_valid(key)
    }

    /// SHA-256 (hex) of the entry's line in the log: what the next entry's `prev_hash`
    /// names, so the digest ties a copy of the receipt to the chain.
    pub fn digest(&self) -> Result<String, serde_json::Error> {
        Ok(hex::encode(Sha256::digest(serde_json::to_vec(self)?)))
    }

    fn signed_message(&self) -> Result<Vec<u8>, serde_json::Error> {
        let mut msg = ENTRY_DOMAIN.to_vec();
        serde_json::to_writer(
            &mut msg,
            &SignedPart {
                seq: self.seq,
                prev_hash: &self.prev_hash,
                appended_at: &self.appended_at,
                key_id: &self.key_id,
                receipt: &self.receipt,
            },
        )?;
        Ok(msg)
    }

    fn signature_valid(&self, key: &VerifyingKey) -> bool {
        let Ok(msg) = self.signed_message() else {
            return false;
        };
        let Some(sig) = hex::decode(&self.signature)
            .ok()
            .and_then(|b| <[u8; 64]>::try_from(b.as_slice()).ok())
        else {
            return false;
        };
        key.verify_strict(&msg, &Signature::from_bytes(&sig))
            .is_ok()
    }
}

/// The signed head: which entry is the last one appended.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
struct Head {
    seq: u64,
    entry_hash: String,
    signature: String,
}

impl Head {
    fn message(seq: u64, entry_hash: &str) -> Vec<u8> {
        let mut msg = HEAD_DOMAIN.to_vec();
        msg.extend_from_slice(format!("{seq} {entry_hash}").as_bytes());
        msg
    }

    fn signature_valid(&self, key: &VerifyingKey) -> bool {
        hex::decode(&self.signature)
            .ok()
            .and_then(|b| <[u8; 64]>::try_from(b.as_slice()).ok())
            .is_some_and(|sig| {
                key.verify_strict(
                    &Self::message(self.seq, &self.entry_hash),
                    &Signature::from_bytes(&sig),
                )
                .is_ok()
            })
    }
}

/// One thing wrong with the log; line numbers are 1-based.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ChainProblem {
    /// The line is not an entry.
    #[error("Line {line}: not a log entry ({reason})")]
    Unparseable {
        /// Line number.
        line: usize,
        /// The parser's complaint.
        reason: String,
    },
    /// The line parses but is not byte-for-byte as it was written (edited formatting).
    #[error("Line {line}: not in canonical form (edited)")]
    NotCanonical {
        /// Line number.
        line: usize,
    },
    /// The signature does not match the content (edited entry or foreign key).
    #[error("Line {line} (seq {seq}): bad signature (entry edited or signed by another key)")]
    BadSignature {
        /// Line number.
        line: usize,
        /// The entry's claimed sequence number.
        seq: u64,
    },
    /// The sequence number is not the next one (entry removed or reordered).
    #[error(
        "Line {line}: sequence number {found}, expected {expected} (entry removed or reordered)"
    )]
    WrongSequence {
        /// Line number.
        line: usize,
        /// What it should be.
        expected: u64,
        /// What it is.
        found: u64,
    },
    /// `prev_hash` is not the hash of the previous line.
    #[error("Line {line} (seq {seq}): previous-entry hash does not match (entry before it edited, removed or reordered)")]
    BrokenChain {
        /// Line number.
        line: usize,
        /// The entry's sequence number.
        seq: u64,
    },
    /// The last line is incomplete (a crash during an append; the next append repairs it).
    #[error("Line {line}: incomplete last line (interrupted append)")]
    TornTail {
        /// Line number.
        line: usize,
    },
    /// Entries exist but the head file does not.
    #[error("The head file is missing")]
    HeadMissing,
    /// The head file is not validly signed.
    #[error("The head file is damaged or its signature is bad")]
    HeadInvalid,
    /// The log ends before the entry the head names (entries removed from the end).
    #[error("The head names entry {head_seq} but the log holds only {entries} entries (entries removed from the end)")]
    Truncated {
        /// The head's last entry.
        head_seq: u64,
        /// Entries in the log.
        entries: usize,
    },
    /// The entry the head names has another hash.
    #[error("Entry {seq} differs from the one the head names")]
    HeadMismatch {
        /// The entry.
        seq: u64,
    },
    /// An earlier log failed verification and was set aside (kept byte for byte) so that
    /// departures could go on; this log's chain starts after it.
    #[error("A damaged earlier log was set aside at {}: verify it with `tenantvm receipt verify --log {}`, keep it as evidence, then move it out of this directory", path.display(), path.display())]
    SetAside {
        /// The set-aside log.
        path: PathBuf,
    },
}

/// The result of [`AuditLog::verify`].
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct VerifyReport {
    /// Lines read.
    pub entries: usize,
    /// SHA-256 of the last line, the chain's current value.
    pub last_hash: Option<String>,
    /// The entry the signed head names.
    pub head_seq: Option<u64>,
    /// Everything wrong; empty when the log is intact.
    #[serde(serialize_with = "problems_as_text")]
    pub problems: Vec<ChainProblem>,
    /// Damaged earlier logs set aside next to this one, oldest first.
    pub set_aside: Vec<PathBuf>,
}

fn problems_as_text<S: serde::Serializer>(p: &[ChainProblem], s: S) -> Result<S::Ok, S::Error> {
    s.collect_seq(p.iter().map(ToString::to_string))
}

impl VerifyReport {
    /// Whether no problem was found.
    pub fn is_intact(&self) -> bool {
        self.problems.is_empty()
    }
}

/// An append-only, hash-chained, signed log of departure receipts.
#[derive(Debug, Clone)]
pub struct AuditLog {
    path: PathBuf,
}

impl AuditLog {
    /// The log at `path` (created on first append).
    pub fn new(path: &Path) -> Self {
        AuditLog {
            path: path.to_path_buf(),
        }
    }

    fn head_path(&self) -> PathBuf {
        let mut name = self.path.as_os_str().to_owned();
        name.push(".head");
        PathBuf::from(name)
    }

    fn io_err(&self, action: &'static str) -> impl FnOnce(io::Error) -> ReceiptError {
        let path = self.path.display().to_string();
        move |source| ReceiptError::Io {
            action,
            path,
            source,
        }
    }

    fn read_raw(&self) -> Result<Vec<u8>, ReceiptError> {
        match fs::read(&self.path) {
            Ok(data) => Ok(data),
            Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(Vec::new()),
            Err(e) => Err(self.io_err("read")(e)),
        }
    }

    /// Every entry that parses, oldest first: those of set-aside logs, then this log's (not
    /// verified: use [`AuditLog::verify`] for that). A line that does not parse is skipped
    /// (verification reports it), so one damaged entry never hides the others.
    pub fn entries(&self) -> Result<Vec<LogEntry>, ReceiptError> {
        let mut all = Vec::new();
        for path in self.set_aside_logs()? {
            all.extend(AuditLog::new(&path).readable_entries()?);
        }
        all.extend(self.readable_entries()?);
        Ok(all)
    }

    /// This log's entries that parse.
    fn readable_entries(&self) -> Result<Vec<LogEntry>, ReceiptError> {
        let data = self.read_raw()?;
        let mut out = Vec::new();
        for (i, line) in complete_lines(&data).0.iter().enumerate() {
            match parse_line(line) {
                Ok(entry) => out.push(entry),
                Err(reason) => tracing::warn!(
                    log = %self.path.display(),
                    line = i + 1,
                    %reason,
                    "skipping a damaged audit log line (`tenantvm receipt verify` reports it)"
                ),
            }
        }
        Ok(out)
    }

    /// This log's entries, all of which must parse (after a clean verification).
    fn strict_entries(&self) -> Result<Vec<LogEntry>, ReceiptError> {
        let data = self.read_raw()?;
        complete_lines(&data)
            .0
            .iter()
            .enumerate()
            .map(|(i, line)| {
                parse_line(line).map_err(|reason| ReceiptError::Damaged {
                    path: self.path.display().to_string(),
                    line: i + 1,
                    reason,
                })
            })
            .collect()
    }

    /// Damaged logs set aside next to this one (`<log>.damaged-<time>`), oldest first.
    pub fn set_aside_logs(&self) -> Result<Vec<PathBuf>, ReceiptError> {
        let (Some(dir), Some(name)) = (self.path.parent(), self.path.file_name()) else {
            return Ok(Vec::new());
        };
        let dir = if dir.as_os_str().is_empty() {
            Path::new(".")
        } else {
            dir
        };
        let prefix = format!("{}{SET_ASIDE_INFIX}", name.to_string_lossy());
        let entries = match fs::read_dir(dir) {
            Ok(entries) => entries,
            Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(Vec::new()),
            Err(e) => return Err(self.io_err("list the directory of")(e)),
        };
        let mut found: Vec<PathBuf> = entries
            .filter_map(|e| e.ok())
            .filter_map(|e| {
                let n = e.file_name().to_string_lossy().into_owned();
                (n.starts_with(&prefix) && !n.ends_with(".head")).then(|| dir.join(n))
            })
            .collect();
        found.sort();
        Ok(found)
    }

    /// Moves a log that failed verification (and its head) aside, byte for byte, so that a
    /// new chain can start: `<log>.damaged-<UTC time>[-n]`. Returns the new name.
    fn set_aside(&self) -> Result<PathBuf, ReceiptError> {
        let stamp: String = now_rfc3339()
            .chars()
            .filter(|c| c.is_ascii_alphanumeric())
            .collect();
        let base = format!("{}{SET_ASIDE_INFIX}{stamp}", self.path.display());
        let mut target = PathBuf::from(&base);
        let mut n = 1;
        while fs::symlink_metadata(&target).is_ok() {
            n += 1;
            target = PathBuf::from(format!("{base}-{n}"));
        }
        let target_head = AuditLog::new(&target).head_path();
        match fs::rename(self.head_path(), &target_head) {
            Ok(()) => {}
            Err(e) if e.kind() == io::ErrorKind::NotFound => {}
            Err(e) => return Err(self.io_err("set aside the head of")(e)),
        }
        fs::rename(&self.path, &target).map_err(self.io_err("set aside"))?;
        if let Some(dir) = self.path.parent() {
            crate::keys::sync_dir(dir).map_err(self.io_err("sync the directory of"))?;
        }
        Ok(target)
    }

    /// Checks every entry's form, sequence, chain link and signature under `key`, and the
    /// signed head. Entries after the head's are accepted when signed and chained (an append
    /// interrupted before its head update).
    pub fn verify(&self, key: &VerifyingKey) -> Result<VerifyReport, ReceiptError> {
        let data = self.read_raw()?;
        let (lines, torn) = complete_lines(&data);
        let mut problems = Vec::new();
        let mut prev = GENESIS.to_string();
        let mut hashes = Vec::with_capacity(lines.len());
        for (i, line) in lines.iter().enumerate() {
            let n = i + 1;
            let expected = i as u64;
            let hash = hex::encode(Sha256::digest(line));
            match parse_line(line) {
                Err(reason) => problems.push(ChainProblem::Unparseable { line: n, reason }),
                Ok(entry) => {
                    if serde_json::to_vec(&entry).ok().as_deref() != Some(*line) {
                        problems.push(ChainProblem::NotCanonical { line: n });
                    }
                    if entry.seq != expected {
                        problems.push(ChainProblem::WrongSequence {
                            line: n,
                            expected,
                            found: entry.seq,
                        });
                    }
                    if entry.prev_hash != prev {
                        problems.push(ChainProblem::BrokenChain {
                            line: n,
                            seq: entry.seq,
                        });
                    }
                    if !entry.signature_valid(key) {
                        problems.push(ChainProblem::BadSignature {
                            line: n,
                            seq: entry.seq,
                        });
                    }
                }
            }
            prev.clone_from(&hash);
            hashes.push(hash);
        }
        if torn.is_some() {
            problems.push(ChainProblem::TornTail {
                line: lines.len() + 1,
            });
        }
        let head = self.read_head()?;
        let mut head_seq = None;
        match head {
            None if !lines.is_empty() => problems.push(ChainProblem::HeadMissing),
            None => {}
            Some(None) => problems.push(ChainProblem::HeadInvalid),
            Some(Some(head)) if !head.signature_valid(key) => {
                problems.push(ChainProblem::HeadInvalid);
            }
            Some(Some(head)) => {
                head_seq = Some(head.seq);
                match usize::try_from(head.seq).ok().and_then(|i| hashes.get(i)) {
                    None => problems.push(ChainProblem::Truncated {
                        head_seq: head.seq,
                        entries: lines.len(),
                    }),
                    Some(hash) if *hash != head.entry_hash => {
                        problems.push(ChainProblem::HeadMismatch { seq: head.seq });
                    }
                    Some(_) => {}
                }
            }
        }
        let set_aside = self.set_aside_logs()?;
        problems.extend(
            set_aside
                .iter()
                .map(|path| ChainProblem::SetAside { path: path.clone() }),
        );
        Ok(VerifyReport {
            entries: lines.len(),
            last_hash: hashes.last().cloned(),
            head_seq,
            problems,
            set_aside,
        })
    }

    /// `None`: no head file; `Some(None)`: a head file that does not parse.
    fn read_head(&self) -> Result<Option<Option<Head>>, ReceiptError> {
        match fs::read(self.head_path()) {
            Ok(data) => Ok(Some(serde_json::from_slice(&data).ok())),
            Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(None),
            Err(e) => Err(self.io_err("read the head of")(e)),
        }
    }

    /// Opens the log for appending and takes its lock, making sure the locked file is still
    /// the one at the path (another appender may have set it aside meanwhile).
    fn open_locked(&self) -> Result<File, ReceiptError> {
        use std::os::unix::fs::MetadataExt;
        loop {
            let file = OpenOptions::new()
                .read(true)
                .append(true)
                .create(true)
                .mode(0o600)
                .custom_flags(libc::O_NOFOLLOW | libc::O_CLOEXEC)
                .open(&self.path)
                .map_err(self.io_err("open"))?;
            lock_exclusive(&file).map_err(self.io_err("lock"))?;
            let held = file.metadata().map_err(self.io_err("stat"))?;
            match fs::symlink_metadata(&self.path) {
                Ok(now) if now.dev() == held.dev() && now.ino() == held.ino() => return Ok(file),
                // Set aside (or replaced) while we waited for the lock: open the new one.
                _ => continue,
            }
        }
    }

    /// Appends `receipt`, signed by `signer`, and moves the head to it. The receipt is first
    /// bounded ([`Receipt::bounded`]) so that its line fits [`MAX_LINE`]: guest text can make
    /// it no longer than that. Idempotent per departure: if the log (or a set-aside one)
    /// already holds this departure's receipt, that entry is returned and nothing is written
    /// (a daemon killed after the append re-runs this safely). A torn last line left by a
    /// crash is removed first. A log that fails verification is set aside, byte for byte,
    /// and the receipt starts a new chain: a damaged entry never blocks later departures,
    /// and `tenantvm receipt verify` keeps reporting the set-aside log.
    pub fn append(
        &self,
        signer: &ReceiptSigner,
        receipt: &Receipt,
    ) -> Result<LogEntry, ReceiptError> {
        let receipt = fit_receipt(receipt)?;
        if let Some(dir) = self.path.parent() {
            create_private_dir(dir).map_err(self.io_err("create the directory of"))?;
        }
        let mut file = self.open_locked()?;
        let data = self.read_raw()?;
        if let (lines, Some(_)) = complete_lines(&data) {
            let keep: usize = lines.iter().map(|l| l.len() + 1).sum();
            file.set_len(keep as u64)
                .and_then(|()| file.sync_all())
                .map_err(self.io_err("remove the torn last line of"))?;
        }
        let mut report = self.verify(&signer.verifying_key())?;
        let blocking = |p: &ChainProblem| {
            !matches!(p, ChainProblem::HeadMissing | ChainProblem::SetAside { .. })
        };
        if let Some(problem) = report.problems.iter().find(|p| blocking(p)) {
            let line = problem_line(problem);
            let moved = self.set_aside()?;
            tracing::error!(
                log = %self.path.display(),
                set_aside = %moved.display(),
                line,
                %problem,
                "the audit log failed verification: it was set aside as evidence and a new chain starts"
            );
            // The lock held is on the set-aside file: take the new log's.
            drop(file);
            file = self.open_locked()?;
            report = self.verify(&signer.verifying_key())?;
        }
        let entries = self.strict_entries()?;
        let earlier = |id: &str| -> Result<Option<LogEntry>, ReceiptError> {
            for path in self.set_aside_logs()? {
                if let Some(e) = AuditLog::new(&path)
                    .readable_entries()?
                    .into_iter()
                    .find(|e| e.receipt.departure_id == id)
                {
                    return Ok(Some(e));
                }
            }
            Ok(None)
        };
        let existing = match entries
            .iter()
            .find(|e| e.receipt.departure_id == receipt.departure_id)
        {
            Some(e) => {
                if e.receipt == receipt {
                    // Finish a head update that a crash may have cut off.
                    if let Some(last) = &report.last_hash {
                        self.write_head(signer, entries.len() as u64 - 1, last)?;
                    }
                }
                Some(e.clone())
            }
            None => earlier(&receipt.departure_id)?,
        };
        if let Some(existing) = existing {
            if existing.receipt == receipt {
                return Ok(existing);
            }
            return Err(ReceiptError::Conflict(receipt.departure_id.clone()));
        }
        let mut entry = LogEntry {
            seq: entries.len() as u64,
            prev_hash: report.last_hash.unwrap_or_else(|| GENESIS.to_string()),
            appended_at: now_rfc3339(),
            key_id: signer.key_id(),
            receipt,
            signature: String::new(),
        };
        entry.signature = hex::encode(signer.key.sign(&entry.signed_message()?).to_bytes());
        let mut line = serde_json::to_vec(&entry)?;
        debug_assert!(line.len() <= MAX_LINE);
        let hash = hex::encode(Sha256::digest(&line));
        line.push(b'\n');
        (&file)
            .write_all(&line)
            .and_then(|()| file.sync_all())
            .map_err(self.io_err("append to"))?;
        self.write_head(signer, entry.seq, &hash)?;
        unlock(&file);
        Ok(entry)
    }

    /// Points the signed head at the last line: `seq` and the SHA-256 of that line.
    fn write_head(&self, signer: &ReceiptSigner, seq: u64, hash: &str) -> Result<(), ReceiptError> {
        let signature = hex::encode(signer.key.sign(&Head::message(seq, hash)).to_bytes());
        let head = Head {
            seq,
            entry_hash: hash.to_string(),
            signature,
        };
        write_private_atomic(&self.head_path(), &serde_json::to_vec(&head)?)
            .map_err(self.io_err("write the head of"))
    }
}

fn problem_line(p: &ChainProblem) -> usize {
    match p {
        ChainProblem::Unparseable { line, .. }
        | ChainProblem::NotCanonical { line }
        | ChainProblem::BadSignature { line, .. }
        | ChainProblem::WrongSequence { line, .. }
        | ChainProblem::BrokenChain { line, .. }
        | ChainProblem::TornTail { line } => *line,
        _ => 0,
    }
}

/// The complete (newline-terminated) lines, and the incomplete tail if any.
fn complete_lines(data: &[u8]) -> (Vec<&[u8]>, Option<&[u8]>) {
    let mut lines: Vec<&[u8]> = data.split(|&b| b == b'\n').collect();
    // split yields a final piece after the last newline: empty when the data ends cleanly.
    let tail = lines.pop().filter(|t| !t.is_empty());
    (lines, tail)
}

fn parse_line(line: &[u8]) -> Result<LogEntry, String> {
    if line.len() > MAX_LINE {
        return Err(format!("line longer than {MAX_LINE} bytes"));
    }
    serde_json::from_slice(line).map_err(|e| e.to_string())
}

/// The receipt bounded so that its log line fits [`MAX_LINE`]: every guest-influenced field
/// at most [`crate::untrusted::MAX_FIELD_BYTES`] and 64 pieces of evidence per step, tighter
/// if that is still too long.
fn fit_receipt(receipt: &Receipt) -> Result<Receipt, ReceiptError> {
    for (field, evidence) in [(crate::untrusted::MAX_FIELD_BYTES, 64), (512, 16), (128, 4)] {
        let bounded = receipt.bounded(field, evidence);
        if serde_json::to_vec(&bounded)?.len() + ENTRY_OVERHEAD <= MAX_LINE {
            return Ok(bounded);
        }
    }
    Err(ReceiptError::Damaged {
        path: "(receipt being appended)".into(),
        line: 0,
        reason: format!("the receipt cannot be bounded to a {MAX_LINE} byte line"),
    })
}

/// Takes an exclusive `flock` on `file`, so that two processes never append at once; it is
/// released by [`unlock`] or when the file is closed.
fn lock_exclusive(file: &File) -> io::Result<()> {
    // SAFETY: flock only takes the descriptor, which `file` keeps open.
    if unsafe { libc::flock(file.as_raw_fd(), libc::LOCK_EX) } != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

fn unlock(file: &File) {
    // SAFETY: as in `lock_exclusive`; unlocking cannot affect memory safety.
    unsafe { libc::flock(file.as_raw_fd(), libc::LOCK_UN) };
}

#[cfg(test)]
mod tests;
