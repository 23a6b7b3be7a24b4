//! Reading a tenant's logs for the API: the serial console and VMM log through the
//! runtime's [`crate::logs::TenantLogs`] (capped, rotated, sanitised), and lifecycle events
//! from the store.

use serde::{Deserialize, Serialize};

use crate::logs::{LogCursor, LogKind, LogPolicy, TenantLogs, MAX_CHUNK_BYTES, MAX_TAIL_LINES};
use crate::receipt::rfc3339_from_millis;
use crate::store::{EventRecord, Store, StoreError, TenantRecord};
use crate::tenant::config::ServiceConfig;

/// A piece of a log as the service reads it; the API shows it as a `LogChunk` (its events
/// projected).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LogRead {
    /// The stream read.
    pub stream: LogStream,
    /// The text (for events: one line per event).
    pub text: String,
    /// Where the next read starts.
    pub next: LogPosition,
    /// Whether the cursor pointed at text already rotated away (what is returned starts
    /// at the oldest text kept).
    pub skipped: bool,
    /// The events read (the events stream only).
    pub events: Vec<EventRecord>,
}

/// Which log a `GET /v1/tenants/{name}/logs` reads.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(rename_all = "lowercase")]
pub enum LogStream {
    /// The guest's serial console.
    #[default]
    Serial,
    /// The VMM's own log.
    Vmm,
    /// Lifecycle events from the store.
    Events,
}

/// Query of `GET /v1/tenants/{name}/logs`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(deny_unknown_fields)]
pub struct LogQuery {
    /// Which log.
    #[serde(default)]
    pub stream: LogStream,
    /// Continue from this cursor (`next` of the previous chunk): rotation generation...
    pub generation: Option<u64>,
    /// ...and byte offset (for `events`: the last event id seen). Without a cursor the
    /// last `tail` lines (or events) are returned.
    pub offset: Option<u64>,
    /// Lines (or events) to return when no cursor is given (default 100, at most 10,000).
    pub tail: Option<u64>,
    /// Most bytes to return when following (default 64 KiB, at most 1 MiB).
    pub max_bytes: Option<u64>,
}

/// Where a log reader is.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(deny_unknown_fields)]
pub struct LogPosition {
    /// Rotation generation (0 for events).
    pub generation: u64,
    /// Byte offset in that generation (for events: the last event id).
    pub offset: u64,
}

/// Why a log could not be read.
#[derive(Debug, thiserror::Error)]
pub enum LogReadError {
    /// The query is out of range.
    #[error("Bad request: {0}")]
    BadRequest(String),
    /// The log files could not be read.
    #[error("Cannot read the log: {0}")]
    Log(String),
    /// The store failed (events).
    #[error(transparent)]
    Store(#[from] StoreError),
}

/// Lines (or events) returned when no cursor and no `tail` is given.
pub const DEFAULT_TAIL: u64 = 100;
/// Bytes returned per follow read when no `max_bytes` is given.
pub const DEFAULT_MAX_BYTES: u64 = 64 << 10;

/// Reads a chunk of one of a tenant's logs.
pub fn read(
    store: &Store,
    config: &ServiceConfig,
    t: &TenantRecord,
    q: &LogQuery,
) -> Result<LogRead, LogReadError> {
    let tail = q
        .tail
        .unwrap_or(DEFAULT_TAIL)
        .clamp(1, MAX_TAIL_LINES as u64);
    let kind = match q.stream {
        LogStream::Serial => LogKind::Serial,
        LogStream::Vmm => LogKind::Vmm,
        LogStream::Events => return read_events(store, t, q, tail),
    };
    let root = config.tenants_dir();
    if !root.join(&t.name).is_dir() {
        // Nothing provisioned yet (or already removed): an empty log, not an error.
        return Ok(LogRead {
            stream: q.stream,
            text: String::new(),
            next: LogPosition::default(),
            skipped: false,
            events: Vec::new(),
        });
    }
    let logs = TenantLogs::open(&root, &t.name, LogPolicy::default()).map_err(log_err)?;
    match (q.generation, q.offset) {
        (None, None) => {
            let lines: Vec<String> = logs
                .tail(kind, tail as usize)
                .map_err(log_err)?
                .into_iter()
                .map(crlf_to_lf)
                .collect();
            let end = logs.end(kind).map_err(log_err)?;
            let mut text = lines.join("\n");
            if !text.is_empty() {
                text.push('\n');
            }
            Ok(LogRead {
                stream: q.stream,
                text,
                next: LogPosition {
                    generation: end.generation,
                    offset: end.offset,
                },
                skipped: false,
                events: Vec::new(),
            })
        }
        (generation, offset) => {
            let max = q
                .max_bytes
                .unwrap_or(DEFAULT_MAX_BYTES)
                .clamp(1, MAX_CHUNK_BYTES as u64) as usize;
            let cursor = LogCursor {
                generation: generation.unwrap_or(0),
                offset: offset.unwrap_or(0),
            };
            let chunk = logs.read_from(kind, cursor, max).map_err(log_err)?;
            Ok(LogRead {
                stream: q.stream,
                text: crlf_to_lf(chunk.text),
                next: LogPosition {
                    generation: chunk.next.generation,
                    offset: chunk.next.offset,
                },
                skipped: chunk.skipped,
                events: Vec::new(),
            })
        }
    }
}

fn read_events(
    store: &Store,
    t: &TenantRecord,
    q: &LogQuery,
    tail: u64,
) -> Result<LogRead, LogReadError> {
    let events = match q.offset {
        Some(after) => store.events(t.id, i64::try_from(after).unwrap_or(i64::MAX), 1000)?,
        None => {
            let mut all = store.events(t.id, 0, u32::MAX)?;
            let skip = all.len().saturating_sub(tail as usize);
            all.drain(..skip);
            all
        }
    };
    let last = events.last().map_or(q.offset.unwrap_or(0), |e| e.id as u64);
    let text = events
        .iter()
        .map(|e| {
            format!(
                "{} {:<5} {}\n",
                rfc3339_from_millis(e.at_ms),
                e.kind,
                e.message
            )
        })
        .collect();
    Ok(LogRead {
        stream: q.stream,
        text,
        next: LogPosition {
            generation: 0,
            offset: last,
        },
        skipped: false,
        events,
    })
}

/// Serial consoles end lines with CRLF; the runtime's sanitiser turns the CR into U+FFFD
/// like every other control character. Drop it where it ends a line.
fn crlf_to_lf(text: String) -> String {
    if text.contains("\u{fffd}\n") || text.ends_with('\u{fffd}') {
        let t = text.replace("\u{fffd}\n", "\n");
        t.strip_suffix('\u{fffd}').map(str::to_string).unwrap_or(t)
    } else {
        text
    }
}

fn log_err(e: crate::logs::LogError) -> LogReadError {
    match e {
        crate::logs::LogError::InvalidRequest(m) => LogReadError::BadRequest(m),
        other => LogReadError::Log(crate::jail::error_chain(&other)),
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn crlf_line_ends_lose_their_replaced_cr() {
        assert_eq!(super::crlf_to_lf("a\u{fffd}\nb\u{fffd}".into()), "a\nb");
        assert_eq!(super::crlf_to_lf("a\u{fffd}b\n".into()), "a\u{fffd}b\n");
    }
}
