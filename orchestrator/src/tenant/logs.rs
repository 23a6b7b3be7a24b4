//! Reading a tenant's logs for the API: the serial console and VMM log files in the tenant
//! directory (written by the runtime), and lifecycle events from the store.

use std::fs::File;
use std::io::{ErrorKind, Read, Seek, SeekFrom};

use crate::api::types::{LogChunk, LogQuery, LogStream};
use crate::store::TenantRecord;
use crate::tenant::service::{TenantService, TenantServiceError};

/// Most bytes (or events) one read returns.
pub const MAX_CHUNK: u64 = 1 << 20;
/// Bytes (or events) returned when no limit is given.
pub const DEFAULT_CHUNK: u64 = 64 << 10;
/// How much of the end of a file a read without an offset returns.
pub const DEFAULT_TAIL: u64 = 16 << 10;

/// File name of a stream in the tenant directory.
pub fn file_name(stream: LogStream) -> Option<&'static str> {
    match stream {
        LogStream::Serial => Some("serial.log"),
        LogStream::Vmm => Some("vmm.log"),
        LogStream::Events => None,
    }
}

/// Reads a chunk of one of a tenant's logs.
pub fn read(
    svc: &TenantService,
    t: &TenantRecord,
    q: &LogQuery,
) -> Result<LogChunk, TenantServiceError> {
    let limit = q.limit.unwrap_or(DEFAULT_CHUNK).clamp(1, MAX_CHUNK);
    let Some(name) = file_name(q.stream) else {
        let after = q.offset.unwrap_or(0);
        let events = svc.store().events(
            t.id,
            i64::try_from(after).unwrap_or(i64::MAX),
            u32::try_from(limit).unwrap_or(u32::MAX),
        )?;
        let next = events.last().map(|e| e.id as u64).unwrap_or(after);
        return Ok(LogChunk {
            stream: q.stream,
            offset: after,
            next_offset: next,
            data: String::new(),
            events,
        });
    };
    let path = svc.config().tenant_dir(&t.name).join(name);
    let io_err = |source| TenantServiceError::Log {
        path: path.clone(),
        source,
    };
    let mut file = match File::open(&path) {
        Ok(f) => f,
        Err(e) if e.kind() == ErrorKind::NotFound => {
            let offset = q.offset.unwrap_or(0);
            return Ok(LogChunk {
                stream: q.stream,
                offset,
                next_offset: offset,
                data: String::new(),
                events: Vec::new(),
            });
        }
        Err(e) => return Err(io_err(e)),
    };
    let size = file.metadata().map_err(io_err)?.len();
    let start = match q.offset {
        // Past the end means the file was rotated or truncated: start over.
        Some(o) if o > size => 0,
        Some(o) => o,
        None => size.saturating_sub(DEFAULT_TAIL.min(limit)),
    };
    file.seek(SeekFrom::Start(start)).map_err(io_err)?;
    let mut buf = Vec::new();
    file.take(limit).read_to_end(&mut buf).map_err(io_err)?;
    Ok(LogChunk {
        stream: q.stream,
        offset: start,
        next_offset: start + buf.len() as u64,
        data: String::from_utf8_lossy(&buf).into_owned(),
        events: Vec::new(),
    })
}
