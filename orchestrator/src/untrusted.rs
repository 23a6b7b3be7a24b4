//! Text a tenant controls (guest agent replies, payload errors, serial output, anything a
//! guest or its VMM wrote) on its way to an operator: bounded and escaped **at the sinks**
//! that keep or show it, so that no caller can forget.
//!
//! - [`GuestLine`]: one line, at most [`MAX_FIELD_BYTES`], every control character escaped
//!   (newlines included, so no line can be forged). The receipt writer
//!   ([`crate::receipt::AuditLog::append`]), the event writers (the store's events, step and
//!   tenant errors, [`crate::logs::TenantLogs::append_event`]), the daemon's own log
//!   ([`LineSafeWriter`]) and the CLI's one-line fields all pass text through it.
//! - [`multi_line`]: text whose newlines are meaningful (a serial console, a completion):
//!   control characters other than newline and tab replaced, for terminals.
//!
//! Escaping is idempotent (escaped text holds no control character, and backslashes are
//! left alone), so text that passes several sinks (an error stored, served by the API, then
//! printed by the CLI) is escaped once, and a bounded string bounded again is unchanged.

use std::fmt;
use std::io::{self, Write};

/// The most bytes of one field of guest text that any sink keeps (marker included).
pub const MAX_FIELD_BYTES: usize = 4096;
/// The most bytes of one record of a line-oriented log ([`LineSafeWriter`]), marker
/// included, before its newline: room for a few fields of guest text.
pub const MAX_RECORD_BYTES: usize = 4 * MAX_FIELD_BYTES;

/// One line of text a tenant controls, bounded to a byte limit and with every control
/// character (C0, DEL, C1, bidirectional overrides, line separators) written as a visible
/// escape (`\n`, `\x1b`, `\u{202e}`). Longer text is cut at a character boundary and ends
/// with a [`TRUNCATED`] marker naming the original length.
#[derive(Debug, Clone, PartialEq, Eq, Hash, serde::Serialize)]
#[serde(transparent)]
pub struct GuestLine(String);

/// Start of the marker that ends a truncated [`GuestLine`].
pub const TRUNCATED: &str = "…[truncated: ";

impl GuestLine {
    /// `text` bounded to [`MAX_FIELD_BYTES`] and escaped.
    pub fn new(text: &str) -> Self {
        Self::bounded(text, MAX_FIELD_BYTES)
    }

    /// `text` escaped and bounded to `max` bytes (at least 64), marker included.
    pub fn bounded(text: &str, max: usize) -> Self {
        let max = max.max(64);
        let mut out = String::with_capacity(text.len().min(max));
        let mut cut = false;
        for c in text.chars() {
            let before = out.len();
            push_escaped(&mut out, c);
            if out.len() > max {
                out.truncate(before);
                cut = true;
                break;
            }
        }
        if cut {
            let marker = format!("{TRUNCATED}{} bytes in all]", text.len());
            // Make room for the marker, at a character boundary.
            let mut keep = max.saturating_sub(marker.len()).min(out.len());
            while !out.is_char_boundary(keep) {
                keep -= 1;
            }
            // Never split an escape sequence: drop a partial one at the end.
            if let Some(pos) = out[..keep].rfind('\\') {
                if !escape_complete(&out[pos..keep]) {
                    keep = pos;
                }
            }
            out.truncate(keep);
            out.push_str(&marker);
        }
        GuestLine(out)
    }

    /// Whether the text was cut.
    pub fn is_truncated(&self) -> bool {
        self.0.contains(TRUNCATED)
    }

    /// The safe text.
    pub fn as_str(&self) -> &str {
        &self.0
    }

    /// The safe text, owned.
    pub fn into_string(self) -> String {
        self.0
    }
}

impl fmt::Display for GuestLine {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl From<&str> for GuestLine {
    fn from(text: &str) -> Self {
        GuestLine::new(text)
    }
}

impl From<&String> for GuestLine {
    fn from(text: &String) -> Self {
        GuestLine::new(text)
    }
}

impl From<String> for GuestLine {
    fn from(text: String) -> Self {
        GuestLine::new(&text)
    }
}

/// `text` as one safe line of at most [`MAX_FIELD_BYTES`]: [`GuestLine::new`] as a string.
pub fn one_line(text: &str) -> String {
    GuestLine::new(text).into_string()
}

/// Whether `c` must never reach a terminal or a line-oriented file as itself.
pub fn is_unsafe_char(c: char) -> bool {
    c.is_control()
        || matches!(
            c,
            // Bidirectional embeddings, overrides and isolates: they reorder what a reader sees.
            '\u{200e}' | '\u{200f}' | '\u{202a}'..='\u{202e}' | '\u{2066}'..='\u{2069}'
            // Line and paragraph separators: some viewers break lines on them.
            | '\u{2028}' | '\u{2029}'
        )
}

fn push_escaped(out: &mut String, c: char) {
    use std::fmt::Write as _;
    if !is_unsafe_char(c) {
        out.push(c);
        return;
    }
    let _ = match c {
        '\n' => write!(out, "\\n"),
        '\r' => write!(out, "\\r"),
        '\t' => write!(out, "\\t"),
        c if (c as u32) < 0x80 => write!(out, "\\x{:02x}", c as u32),
        c => write!(out, "\\u{{{:x}}}", c as u32),
    };
}

/// Whether `s` (starting at a backslash) is a whole escape as [`push_escaped`] writes it.
fn escape_complete(s: &str) -> bool {
    let b = s.as_bytes();
    match b.get(1) {
        Some(b'n' | b'r' | b't') => true,
        Some(b'x') => b.len() >= 4,
        Some(b'u') => s.contains('}'),
        // A backslash of the text itself.
        Some(_) => true,
        None => false,
    }
}

/// Text whose lines matter (a serial console, a completion), made safe for a terminal:
/// newline and tab are kept, every other unsafe character becomes U+FFFD.
pub fn multi_line(text: &str) -> String {
    text.chars()
        .map(|c| {
            if is_unsafe_char(c) && c != '\n' && c != '\t' {
                '\u{fffd}'
            } else {
                c
            }
        })
        .collect()
}

/// A writer for line-oriented logs (the daemon's stderr log) whose records may carry guest
/// text: each `write` is taken as a whole record (the log formatter writes one per event),
/// and everything in it but its final newline is escaped and bounded to
/// [`MAX_RECORD_BYTES`] as in [`GuestLine`], so a record is always exactly one line of
/// bounded length, whatever a field quoted.
#[derive(Debug)]
pub struct LineSafeWriter<W: Write> {
    inner: W,
}

impl<W: Write> LineSafeWriter<W> {
    /// Wraps `inner`.
    pub fn new(inner: W) -> Self {
        LineSafeWriter { inner }
    }
}

impl<W: Write> Write for LineSafeWriter<W> {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        let text = String::from_utf8_lossy(buf);
        let (body, newline) = match text.strip_suffix('\n') {
            Some(body) => (body, true),
            None => (&*text, false),
        };
        let mut out = GuestLine::bounded(body, MAX_RECORD_BYTES).into_string();
        if newline {
            out.push('\n');
        }
        self.inner.write_all(out.as_bytes())?;
        Ok(buf.len())
    }

    fn flush(&mut self) -> io::Result<()> {
        self.inner.flush()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn control_characters_become_visible_escapes_on_one_line() {
        let line = GuestLine::new("a\nb\r\x1b[2J\tc\u{7f}\u{9b}\u{202e}d");
        assert_eq!(line.as_str(), "a\\nb\\r\\x1b[2J\\tc\\x7f\\u{9b}\\u{202e}d");
        assert!(!line.as_str().chars().any(is_unsafe_char));
        assert!(!line.is_truncated());
    }

    #[test]
    fn long_text_is_cut_and_says_so() {
        let big = "x".repeat(4 << 20);
        let line = GuestLine::new(&big);
        assert!(
            line.as_str().len() <= MAX_FIELD_BYTES,
            "{}",
            line.as_str().len()
        );
        assert!(line.is_truncated());
        assert!(line
            .as_str()
            .ends_with("…[truncated: 4194304 bytes in all]"));
    }

    #[test]
    fn cutting_never_splits_a_character_or_an_escape() {
        for n in 0..8 {
            let text = format!("{}{}", "é".repeat(n), "\x1b".repeat(200));
            let line = GuestLine::bounded(&text, 64);
            let s = line.as_str();
            assert!(s.len() <= 64, "{s}");
            let body = s.split(TRUNCATED).next().unwrap();
            // Every backslash left starts a whole \x1b.
            assert!(
                body.match_indices('\\')
                    .all(|(i, _)| body[i..].starts_with("\\x1b")),
                "{s}"
            );
        }
    }

    #[test]
    fn escaping_and_bounding_are_idempotent() {
        for text in [
            "plain".to_string(),
            "two\nlines\u{1b}".to_string(),
            "\u{9b}".repeat(5000),
            "y".repeat(10_000),
            "back\\slash \\n literal".to_string(),
        ] {
            let once = GuestLine::new(&text);
            let twice = GuestLine::new(once.as_str());
            assert_eq!(once, twice, "{text:?}");
        }
    }

    #[test]
    fn multi_line_keeps_newlines_and_tabs_only() {
        assert_eq!(
            multi_line("a\n\tb\x1b[31m\r\u{202e}"),
            "a\n\tb\u{fffd}[31m\u{fffd}\u{fffd}"
        );
    }

    #[test]
    fn line_safe_writer_keeps_each_record_on_one_line() {
        let mut out = Vec::new();
        let mut w = LineSafeWriter::new(&mut out);
        w.write_all(b"INFO tenant=a agent=1.0\ncrypto-shred ok verified\x1b[2K\n")
            .unwrap();
        w.write_all(b"INFO next\n").unwrap();
        let text = String::from_utf8(out).unwrap();
        assert_eq!(
            text,
            "INFO tenant=a agent=1.0\\ncrypto-shred ok verified\\x1b[2K\nINFO next\n"
        );
    }

    #[test]
    fn line_safe_writer_bounds_each_record() {
        let mut out = Vec::new();
        let mut w = LineSafeWriter::new(&mut out);
        let record = format!("WARN error={}\n", "E".repeat(4 << 20));
        w.write_all(record.as_bytes()).unwrap();
        let text = String::from_utf8(out).unwrap();
        assert_eq!(text.lines().count(), 1);
        assert!(text.len() <= MAX_RECORD_BYTES + 1, "{}", text.len());
        assert!(text.starts_with("WARN error=EEE") && text.ends_with("bytes in all]\n"));
    }
}
