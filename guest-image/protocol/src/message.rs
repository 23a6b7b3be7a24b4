//! The messages of the control channel: the host sends [`RequestFrame`]s, the agent
//! answers each with one [`ResponseFrame`] carrying the same `id`. Each travels as the JSON
//! body of one frame ([`crate::frame`]); every type refuses unknown fields.

use std::fmt;

use serde::{Deserialize, Deserializer, Serialize, Serializer};
use thiserror::Error;
use zeroize::Zeroizing;

use crate::gpu::GpuInfoReply;
use crate::licence::LicenceToken;
use crate::load::{LoadKind, LoadReport, LoadSpec};

/// The vsock port the agent listens on.
pub const AGENT_VSOCK_PORT: u32 = 1024;
/// The name of the virtio-serial port the agent serves when there is no vsock device.
pub const VIRTIO_SERIAL_PORT_NAME: &str = "org.tenantvm.agent.0";
/// Shortest accepted disk key (bytes).
pub const MIN_KEY_LEN: usize = 16;
/// Longest accepted disk key (bytes).
pub const MAX_KEY_LEN: usize = 512;

/// A disk key: raw bytes, hex on the wire, zeroized on drop, never printed.
#[derive(Clone, PartialEq, Eq)]
pub struct DiskKey(Zeroizing<Vec<u8>>);

impl DiskKey {
    /// Wraps raw key bytes; refuses keys outside [`MIN_KEY_LEN`]..=[`MAX_KEY_LEN`].
    pub fn new(bytes: &[u8]) -> Result<Self, KeyError> {
        if !(MIN_KEY_LEN..=MAX_KEY_LEN).contains(&bytes.len()) {
            return Err(KeyError::Length(bytes.len()));
        }
        Ok(Self(Zeroizing::new(bytes.to_vec())))
    }

    /// The raw key bytes.
    pub fn expose(&self) -> &[u8] {
        &self.0
    }
}

/// Why a disk key was refused.
#[derive(Debug, Error, PartialEq, Eq)]
pub enum KeyError {
    /// Wrong length.
    #[error("Disk key is {0} bytes; it must be {MIN_KEY_LEN} to {MAX_KEY_LEN} bytes")]
    Length(usize),
    /// Not hexadecimal.
    #[error("Disk key is not lowercase or uppercase hexadecimal with an even number of digits")]
    NotHex,
}

impl fmt::Debug for DiskKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "DiskKey(<{} bytes redacted>)", self.0.len())
    }
}

fn key_from_hex(s: &str) -> Result<DiskKey, KeyError> {
    crate::secret_hex::decode(s, MIN_KEY_LEN, MAX_KEY_LEN)
        .map(DiskKey)
        .map_err(|e| match e {
            crate::secret_hex::HexError::Length(n) => KeyError::Length(n),
            crate::secret_hex::HexError::NotHex => KeyError::NotHex,
        })
}

impl Serialize for DiskKey {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        crate::secret_hex::serialize(&self.0, s)
    }
}

impl<'de> Deserialize<'de> for DiskKey {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        crate::secret_hex::deserialize(d, "a hexadecimal disk key", key_from_hex)
    }
}

/// An HTTP request forwarded to the payload's port.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct HttpRequest {
    /// Method, e.g. `POST`.
    pub method: String,
    /// Origin-form target, e.g. `/v1/completions`.
    pub path: String,
    /// Extra headers (`Host`, `Content-Length` and `Connection` are set by the agent).
    #[serde(default)]
    pub headers: Vec<(String, String)>,
    /// UTF-8 body (the OpenAI-style API is JSON).
    #[serde(default)]
    pub body: String,
}

/// The payload's HTTP answer.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct HttpResponse {
    /// Status code.
    pub status: u16,
    /// Response headers.
    pub headers: Vec<(String, String)>,
    /// Body, decoded as UTF-8 (invalid sequences replaced).
    pub body: String,
}

/// The head of a streamed answer ([`Request::InferStream`]): what the payload sent before
/// its body. The body follows as data frames ([`crate::frame::encode_data`]).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct HttpHead {
    /// Status code.
    pub status: u16,
    /// Response headers.
    pub headers: Vec<(String, String)>,
}

/// A command from the host.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "cmd", rename_all = "kebab-case", deny_unknown_fields)]
pub enum Request {
    /// Report the agent's state.
    Status,
    /// Open the encrypted data disk with this key.
    UnlockDisk {
        /// The LUKS2 key (raw bytes, hex on the wire).
        key: DiskKey,
    },
    /// Write the tenant's NVIDIA vGPU licence token where the guest's licensing client
    /// reads it ([`crate::licence`]: `/etc/nvidia/ClientConfigToken`, mode 0744), replacing
    /// the one delivered before; answered [`Reply::LicenceInstalled`]. Sent before the
    /// payload starts. An agent older than the request answers `bad-request`.
    InstallLicence {
        /// The token (raw bytes, hex on the wire).
        token: LicenceToken,
    },
    /// Mount the unlocked disk at the data directory.
    Mount {
        /// Create an ext4 file system when the disk holds none (first use).
        format_if_missing: bool,
    },
    /// Start the payload named in the image's config.
    StartPayload,
    /// Report the payload's readiness.
    Health,
    /// Stop the payload (SIGTERM to its process group, then SIGKILL after a grace time)
    /// and start it again, e.g. to serve a model just pushed; answered
    /// [`Reply::PayloadStarted`] once the new process runs (not yet ready: poll
    /// [`Request::Health`]). The crash back-off starts afresh. An agent older than this
    /// request answers `bad-request` (unknown variant).
    RestartPayload,
    /// Return payload and agent log lines with a sequence number above `after`; with
    /// `wait_ms`, wait up to that long (at most 30 s) for a first new line (long poll:
    /// call again with `next` to follow the log as a stream).
    Logs {
        /// Last sequence number already seen (0 for all).
        after: u64,
        /// Most lines to return.
        max: u32,
        /// How long to wait when there is nothing new (0, the default: answer at once).
        #[serde(default)]
        wait_ms: u32,
    },
    /// Forward an HTTP request to the payload.
    Infer(HttpRequest),
    /// Forward an HTTP request to the payload and stream its answer back: a
    /// [`Reply::InferHead`] frame, then the body as it arrives in raw data frames of at most
    /// [`crate::frame::MAX_DATA_LEN`] bytes each, ended by an empty one. The connection
    /// carries nothing else afterwards (one request per connection; a socket channel only),
    /// and the agent closes it without the empty frame if the payload's answer breaks off.
    InferStream(HttpRequest),
    /// Store a model on the encrypted disk (`<data>/models/NAME`, where the payload serves
    /// it by name): the agent answers [`Reply::ModelReady`] (or an error: not mounted, a bad
    /// name, not enough free space), then reads the model as data frames
    /// ([`crate::frame::encode_data`], an empty one at the end), writes it under a
    /// temporary name, checks `size` and `sha256`, fsyncs and renames it, and answers
    /// [`Reply::ModelStored`]. A transfer that breaks off or does not match leaves nothing
    /// visible. Takes the connection (socket channels only).
    ModelPush {
        /// 1-64 characters of `A-Z a-z 0-9 . _ -`, not starting with `.`.
        name: String,
        /// Exact size in bytes.
        size: u64,
        /// SHA-256 of the bytes, lowercase hex.
        sha256: String,
    },
    /// Store a model directory (`<data>/models/NAME/`, e.g. a Hugging-Face layout) as
    /// [`Request::ModelPush`] stores a file: the agent checks the name, every path of
    /// `files` ([`crate::model::check_files`]) and the room for `size` (the files' total)
    /// before answering [`Reply::ModelReady`]; then the files' bytes arrive as one stream of
    /// data frames in `files`' order, each file hashed and checked as it is written under a
    /// temporary directory; `sha256` is the stream's. Once all match, the directory is
    /// fsynced and put in place atomically (swapped with an old one of that name, which is
    /// then removed): the payload sees the whole directory or none of it. Answered
    /// [`Reply::ModelStored`]. An agent older than this answers `bad-request`.
    ModelPushDir {
        /// As [`Request::ModelPush`]'s.
        name: String,
        /// The files, in the order their bytes follow.
        files: Vec<crate::model::ModelFile>,
        /// The files' total size in bytes.
        size: u64,
        /// SHA-256 of all the files' bytes in order, lowercase hex.
        sha256: String,
    },
    /// List the stored models.
    ModelList,
    /// Remove a stored model.
    ModelRemove {
        /// Its name.
        name: String,
    },
    /// Start a bounded test load ([`crate::load`]): one of each kind at a time, answered
    /// [`Reply::LoadStarted`] at once; the load runs in a child process the guest's OOM
    /// killer prefers, and the agent kills it past its deadline. The daemon forwards it
    /// for the admin only (`tenantvm verify`).
    Load(LoadSpec),
    /// Report the latest load of `kind`: [`Reply::Load`].
    LoadStatus {
        /// Which load.
        kind: LoadKind,
    },
    /// Stop the payload, unmount, close the disk, sync and power off.
    Shutdown,
    /// Report the guest's devices ([`crate::gpu`]): its PCI functions and, where the image
    /// has `nvidia-smi`, the GPUs the driver sees; answered [`Reply::GpuInfo`]. No
    /// arguments: the agent runs a fixed query with a deadline. An agent older than this
    /// request answers `bad-request` (unknown variant), which the host reads as "not
    /// supported".
    GpuInfo,
    /// Hello at the start of a virtio-serial channel: the host offers to multiplex the
    /// port ([`crate::mux`]). An agent that knows it answers [`Reply::Mux`] and from the
    /// next byte on the port carries mux frames until the host disconnects; an older one
    /// answers `bad-request` and the channel stays one request at a time.
    Mux {
        /// Mux version the host speaks ([`crate::mux::MUX_VERSION`]).
        version: u32,
        /// Most streams the host will open.
        max_streams: u32,
        /// Credit in bytes each side grants per stream at its start.
        window: u32,
    },
}

/// A stored model.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ModelEntry {
    /// Its name.
    pub name: String,
    /// Size in bytes (of the model file, or of a directory's files together).
    pub bytes: u64,
}

/// A request with its correlation id.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RequestFrame {
    /// Chosen by the host; echoed in the response.
    pub id: u64,
    /// The command.
    pub request: Request,
}

/// The state of the data disk.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum DiskState {
    /// No key delivered yet.
    Locked,
    /// dm-crypt mapping open.
    Unlocked,
    /// Mounted at the data directory.
    Mounted,
}

/// The state of the payload process.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "state", rename_all = "kebab-case")]
pub enum PayloadState {
    /// Not started.
    NotStarted,
    /// Running; `ready` when its port answers the health check.
    Running {
        /// Process id in the guest.
        pid: u32,
        /// Whether the health check passed.
        ready: bool,
        /// How often the agent restarted it after it exited on its own since it was last
        /// started or restarted on request (absent: never; older agents never send it).
        #[serde(default, skip_serializing_if = "is_zero")]
        restarts: u32,
    },
    /// Exited.
    Exited {
        /// Exit code, or 128 + signal.
        code: i32,
        /// Restarts after exits of its own so far (as in `Running`).
        #[serde(default, skip_serializing_if = "is_zero")]
        restarts: u32,
        /// When the agent starts it again (its back-off), if it will.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        restart_in_ms: Option<u64>,
    },
}

fn is_zero(n: &u32) -> bool {
    *n == 0
}

/// The agent's state.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct StatusReply {
    /// Agent version.
    pub agent_version: String,
    /// Protocol version.
    pub protocol: u16,
    /// `vsock` or `virtio-serial`.
    pub channel: String,
    /// Milliseconds since the agent started.
    pub uptime_ms: u64,
    /// The data disk.
    pub disk: DiskState,
    /// The payload.
    pub payload: PayloadState,
}

/// One log line.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct LogLine {
    /// Monotonic sequence number, from 1.
    pub seq: u64,
    /// `agent`, `payload-stdout` or `payload-stderr`.
    pub source: String,
    /// The line, without its newline.
    pub line: String,
}

/// What shutdown did before powering off.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ShutdownReport {
    /// The payload was running and has been stopped.
    pub payload_stopped: bool,
    /// The data directory was unmounted.
    pub unmounted: bool,
    /// The dm-crypt mapping was closed.
    pub disk_closed: bool,
}

/// A successful answer.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "reply", rename_all = "kebab-case", deny_unknown_fields)]
pub enum Reply {
    /// Answer to [`Request::Status`].
    Status(StatusReply),
    /// Answer to [`Request::UnlockDisk`].
    Unlocked,
    /// Answer to [`Request::InstallLicence`]: the token is in place.
    LicenceInstalled,
    /// Answer to [`Request::Mount`].
    Mounted {
        /// A new file system was created.
        formatted: bool,
    },
    /// Answer to [`Request::StartPayload`].
    PayloadStarted {
        /// Process id in the guest.
        pid: u32,
    },
    /// Answer to [`Request::Health`].
    Health {
        /// The payload.
        payload: PayloadState,
    },
    /// Answer to [`Request::Logs`].
    Logs {
        /// The lines, oldest first.
        lines: Vec<LogLine>,
        /// Pass as `after` to continue.
        next: u64,
    },
    /// Answer to [`Request::Infer`].
    Infer(HttpResponse),
    /// First answer to [`Request::InferStream`]; data frames follow.
    InferHead(HttpHead),
    /// First answer to [`Request::ModelPush`] and [`Request::ModelPushDir`]: send the data
    /// frames.
    ModelReady,
    /// Last answer to [`Request::ModelPush`] and [`Request::ModelPushDir`]: the model is in
    /// place.
    ModelStored {
        /// Its name.
        name: String,
        /// Bytes written.
        bytes: u64,
        /// Their SHA-256, as checked.
        sha256: String,
    },
    /// Answer to [`Request::ModelList`].
    Models {
        /// The models, by name.
        models: Vec<ModelEntry>,
    },
    /// Answer to [`Request::ModelRemove`].
    ModelRemoved,
    /// Answer to [`Request::Load`]: the load runs.
    LoadStarted {
        /// The worker's process id in the guest.
        pid: u32,
    },
    /// Answer to [`Request::LoadStatus`].
    Load(LoadReport),
    /// Answer to [`Request::Shutdown`]; the guest powers off after sending it.
    ShuttingDown(ShutdownReport),
    /// Answer to [`Request::GpuInfo`].
    GpuInfo(GpuInfoReply),
    /// Answer to [`Request::Mux`]: the port carries mux frames from now on.
    Mux {
        /// The version agreed (the host's).
        version: u32,
        /// Most streams the agent serves at once (at most the host's offer).
        max_streams: u32,
        /// The per-stream credit, the host's offer echoed.
        window: u32,
    },
}

/// Machine-readable error kinds.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum ErrorCode {
    /// The frame or its JSON was malformed.
    BadRequest,
    /// The frame was larger than [`MAX_BODY_LEN`](crate::frame::MAX_BODY_LEN).
    TooLarge,
    /// The command is not valid in the current state (e.g. mount before unlock).
    WrongState,
    /// The key did not open the disk.
    BadKey,
    /// The payload is not running or did not answer.
    PayloadUnavailable,
    /// The data disk has no room for it.
    NoSpace,
    /// No such model.
    NotFound,
    /// The bytes received do not match the announced size or SHA-256.
    Mismatch,
    /// Anything else inside the guest.
    Internal,
}

/// An error answer.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct AgentFailure {
    /// The kind.
    pub code: ErrorCode,
    /// What went wrong and what to do.
    pub message: String,
}

/// The answer to one request.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case", deny_unknown_fields)]
pub enum Outcome {
    /// Success.
    Ok(Reply),
    /// Failure.
    Err(AgentFailure),
}

/// A response with the id of its request (0 when the request's id was unreadable).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ResponseFrame {
    /// The request's id.
    pub id: u64,
    /// The answer.
    pub outcome: Outcome,
}

/// Extracts the `id` of a request body that failed to decode, so the error can be
/// correlated; 0 when even that is unreadable.
pub fn salvage_id(body: &[u8]) -> u64 {
    #[derive(Deserialize)]
    struct IdOnly {
        id: u64,
    }
    serde_json::from_slice::<IdOnly>(body).map_or(0, |i| i.id)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::frame::{decode_body, encode_frame, HEADER_LEN};

    #[test]
    fn key_travels_as_hex_and_debug_redacts_it() {
        let key = DiskKey::new(&[0xab; 32]).unwrap();
        let req = RequestFrame {
            id: 1,
            request: Request::UnlockDisk { key: key.clone() },
        };
        let bytes = encode_frame(&req).unwrap();
        let text = String::from_utf8_lossy(&bytes[HEADER_LEN..]).to_string();
        assert!(text.contains(&"ab".repeat(32)));
        let back: RequestFrame = decode_body(&bytes[HEADER_LEN..]).unwrap();
        assert_eq!(back.request, Request::UnlockDisk { key });
        let shown = format!("{back:?}");
        assert!(!shown.contains("abab"), "{shown}");
        assert!(shown.contains("redacted"));
    }

    #[test]
    fn key_with_bad_hex_or_length_is_refused() {
        for bad in [
            r#"{"id":1,"request":{"cmd":"unlock-disk","key":"zz"}}"#,
            r#"{"id":1,"request":{"cmd":"unlock-disk","key":"abc"}}"#,
            r#"{"id":1,"request":{"cmd":"unlock-disk","key":"abab"}}"#,
            r#"{"id":1,"request":{"cmd":"unlock-disk","key":7}}"#,
        ] {
            assert!(
                decode_body::<RequestFrame>(bad.as_bytes()).is_err(),
                "{bad}"
            );
        }
        assert_eq!(DiskKey::new(&[1; 8]).unwrap_err(), KeyError::Length(8));
        assert_eq!(
            DiskKey::new(&[1; MAX_KEY_LEN + 1]).unwrap_err(),
            KeyError::Length(MAX_KEY_LEN + 1)
        );
    }

    #[test]
    fn hostile_json_bodies_are_errors_not_panics() {
        let cases: &[&[u8]] = &[
            b"",
            b"\xff\xfe",
            b"null",
            b"[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[",
            br#"{"id":1,"request":{"cmd":"rm-rf"}}"#,
            br#"{"id":1,"request":{"cmd":"mount","format_if_missing":true,"extra":1}}"#,
            br#"{"id":1,"request":{"cmd":"status"},"extra":1}"#,
            br#"{"id":-1,"request":{"cmd":"status"}}"#,
            br#"{"id":1,"request":{"cmd":"logs","after":1,"max":99999999999}}"#,
        ];
        for body in cases {
            assert!(
                decode_body::<RequestFrame>(body).is_err(),
                "{}",
                String::from_utf8_lossy(body)
            );
            decode_body::<ResponseFrame>(body).unwrap_err();
        }
        assert_eq!(salvage_id(br#"{"id":42,"request":{"cmd":"nope"}}"#), 42);
        assert_eq!(salvage_id(b"garbage"), 0);
    }
}
