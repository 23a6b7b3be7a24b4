//! The receiving side's book of a multiplexed channel's streams: at most `max_streams` open
//! at once (the tenant's `max_concurrency`), and per stream the credit it granted, so a
//! peer that sends more than it was allowed, or on a stream that is not open, is caught
//! and only that stream is reset.

use std::collections::BTreeMap;

use thiserror::Error;

use super::MAX_WINDOW;

/// Why a frame breaks a stream's rules; the stream is reset, the channel goes on.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
pub enum StreamError {
    /// An open beyond the bound.
    #[error("stream {stream}: {open} streams are open, the most allowed")]
    TooMany {
        /// The refused stream.
        stream: u32,
        /// How many are open.
        open: usize,
    },
    /// An open of a stream already open.
    #[error("stream {0} is already open")]
    AlreadyOpen(u32),
    /// A frame for a stream that is not open.
    #[error("stream {0} is not open")]
    NotOpen(u32),
    /// More data than the credit granted.
    #[error("stream {stream}: {len} bytes sent with only {credit} granted")]
    OverCredit {
        /// Stream id.
        stream: u32,
        /// Bytes in the frame.
        len: usize,
        /// Credit left.
        credit: u32,
    },
}

/// Open streams and the credit each was granted.
#[derive(Debug)]
pub struct StreamTable {
    max_streams: usize,
    initial_credit: u32,
    open: BTreeMap<u32, u32>,
}

impl StreamTable {
    /// A table allowing `max_streams` open streams (at least 1), each starting with
    /// `initial_credit` bytes (capped at [`MAX_WINDOW`]).
    pub fn new(max_streams: usize, initial_credit: u32) -> Self {
        Self {
            max_streams: max_streams.max(1),
            initial_credit: initial_credit.min(MAX_WINDOW),
            open: BTreeMap::new(),
        }
    }

    /// How many streams are open.
    pub fn len(&self) -> usize {
        self.open.len()
    }

    /// Whether no stream is open.
    pub fn is_empty(&self) -> bool {
        self.open.is_empty()
    }

    /// The peer opens `stream`.
    pub fn open(&mut self, stream: u32) -> Result<(), StreamError> {
        if self.open.contains_key(&stream) {
            return Err(StreamError::AlreadyOpen(stream));
        }
        if self.open.len() >= self.max_streams {
            return Err(StreamError::TooMany {
                stream,
                open: self.open.len(),
            });
        }
        self.open.insert(stream, self.initial_credit);
        Ok(())
    }

    /// The peer sent `len` bytes on `stream`: spends that much of its credit. A stream
    /// that breaks the rule is removed (the caller resets it).
    pub fn receive(&mut self, stream: u32, len: usize) -> Result<(), StreamError> {
        let credit = self
            .open
            .get_mut(&stream)
            .ok_or(StreamError::NotOpen(stream))?;
        match u32::try_from(len) {
            Ok(n) if n <= *credit => {
                *credit -= n;
                Ok(())
            }
            _ => {
                let credit = *credit;
                self.open.remove(&stream);
                Err(StreamError::OverCredit {
                    stream,
                    len,
                    credit,
                })
            }
        }
    }

    /// This side consumed data and grants `credit` more on `stream`; returns the credit
    /// actually granted (outstanding credit never exceeds [`MAX_WINDOW`]; 0: send no
    /// window frame).
    pub fn grant(&mut self, stream: u32, credit: u32) -> Result<u32, StreamError> {
        let left = self
            .open
            .get_mut(&stream)
            .ok_or(StreamError::NotOpen(stream))?;
        let granted = credit.min(MAX_WINDOW - *left);
        *left += granted;
        Ok(granted)
    }

    /// `stream` ended (closed or reset). Idempotent.
    pub fn end(&mut self, stream: u32) {
        self.open.remove(&stream);
    }
}
