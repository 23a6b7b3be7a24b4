//! Reading a tenant's logs for the API: the serial console and VMM log through the
//! runtime's [`crate::logs::TenantLogs`] (capped, rotated, sanitised), and lifecycle events
//! from the store.

use crate::api::types::{LogChunk, LogPosition, LogQuery, LogStream};
use crate::logs::{LogCursor, LogKind, LogPolicy, TenantLogs, MAX_CHUNK_BYTES, MAX_TAIL_LINES};
use crate::receipt::rfc3339_from_millis;
use crate::store::{Store, StoreError, TenantRecord};
use crate::tenant::config::ServiceConfig;

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
) -> Result<LogChunk, LogReadError> {
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
        return Ok(LogChunk {
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
            Ok(LogChunk {
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
            Ok(LogChunk {
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
) -> Result<LogChunk, LogReadError> {
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
    Ok(LogChunk {
        stream: q.stream,
        text,
        next: LogPosition {
            generation: 0,
            offset: last,
        },
        skipped: false,
        events: events.into_iter().map(crate::tenant::view::event).collect(),
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
