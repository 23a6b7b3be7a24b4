//! A bounded in-memory log of agent and payload lines, read by the host with a cursor.

use std::collections::VecDeque;
use std::sync::{Condvar, Mutex};
use std::time::{Duration, Instant};

use tenantvm_agent_protocol::LogLine;

/// Longest kept line; longer lines are cut.
pub const MAX_LINE_LEN: usize = 4096;

/// A ring of the most recent lines with monotonically increasing sequence numbers.
pub struct LogBuffer {
    inner: Mutex<Ring>,
    grew: Condvar,
}

struct Ring {
    lines: VecDeque<LogLine>,
    capacity: usize,
    next_seq: u64,
}

impl LogBuffer {
    /// A buffer keeping the last `capacity` lines.
    pub fn new(capacity: usize) -> Self {
        Self {
            inner: Mutex::new(Ring {
                lines: VecDeque::with_capacity(capacity),
                capacity: capacity.max(1),
                next_seq: 1,
            }),
            grew: Condvar::new(),
        }
    }

    /// Appends a line (cut to [`MAX_LINE_LEN`] bytes on a character boundary).
    pub fn push(&self, source: &str, line: &str) {
        let mut cut = line.len().min(MAX_LINE_LEN);
        while !line.is_char_boundary(cut) {
            cut -= 1;
        }
        let mut ring = self.inner.lock().unwrap_or_else(|p| p.into_inner());
        let seq = ring.next_seq;
        ring.next_seq += 1;
        if ring.lines.len() == ring.capacity {
            ring.lines.pop_front();
        }
        ring.lines.push_back(LogLine {
            seq,
            source: source.to_string(),
            line: line[..cut].to_string(),
        });
        self.grew.notify_all();
    }

    /// [`since`](Self::since), but waits up to `wait` while there is nothing after `after`.
    pub fn wait_since(&self, after: u64, max: usize, wait: Duration) -> (Vec<LogLine>, u64) {
        let deadline = Instant::now() + wait;
        let mut ring = self.inner.lock().unwrap_or_else(|p| p.into_inner());
        while ring.next_seq <= after + 1 {
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                break;
            }
            ring = self
                .grew
                .wait_timeout(ring, left)
                .unwrap_or_else(|p| p.into_inner())
                .0;
        }
        drop(ring);
        self.since(after, max)
    }

    /// Up to `max` lines with a sequence number above `after`, and the cursor to pass next.
    pub fn since(&self, after: u64, max: usize) -> (Vec<LogLine>, u64) {
        let ring = self.inner.lock().unwrap_or_else(|p| p.into_inner());
        let lines: Vec<LogLine> = ring
            .lines
            .iter()
            .filter(|l| l.seq > after)
            .take(max)
            .cloned()
            .collect();
        let next = lines.last().map_or(after, |l| l.seq);
        (lines, next)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cursor_returns_only_new_lines_and_ring_drops_oldest() {
        let b = LogBuffer::new(3);
        for i in 0..5 {
            b.push("agent", &format!("line {i}"));
        }
        let (lines, next) = b.since(0, 10);
        assert_eq!(
            lines.iter().map(|l| l.seq).collect::<Vec<_>>(),
            vec![3, 4, 5]
        );
        assert_eq!(next, 5);
        let (lines, next) = b.since(4, 10);
        assert_eq!(lines.len(), 1);
        assert_eq!(next, 5);
        assert_eq!(b.since(5, 10), (vec![], 5));
        assert_eq!(b.since(0, 1).0.len(), 1);
    }

    #[test]
    fn wait_since_returns_when_a_line_arrives_or_the_wait_ends() {
        let b = std::sync::Arc::new(LogBuffer::new(10));
        b.push("agent", "first");
        // Nothing new: returns empty once the wait is over.
        assert_eq!(b.wait_since(1, 10, Duration::from_millis(50)), (vec![], 1));
        let writer = {
            let b = std::sync::Arc::clone(&b);
            std::thread::spawn(move || {
                std::thread::sleep(Duration::from_millis(100));
                b.push("payload-stdout", "second");
            })
        };
        let (lines, next) = b.wait_since(1, 10, Duration::from_secs(60));
        writer.join().unwrap();
        assert_eq!(lines.len(), 1);
        assert_eq!(lines[0].line, "second");
        assert_eq!(next, 2);
    }

    #[test]
    fn long_lines_are_cut_on_a_char_boundary() {
        let b = LogBuffer::new(2);
        b.push("payload-stdout", &"é".repeat(MAX_LINE_LEN));
        let (lines, _) = b.since(0, 1);
        assert!(lines[0].line.len() <= MAX_LINE_LEN);
    }
}
