//! Report lines on COM1: `TVMTEST <name> PASS <detail>` / `TVMTEST <name> FAIL <reason>`,
//! and the bounded text buffer their details are formatted into.

use core::fmt;

const DETAIL_MAX: usize = 480;

/// A bounded, heap-free string for report details; text past the end is cut off.
pub struct Detail {
    buf: [u8; DETAIL_MAX],
    len: usize,
}

impl Detail {
    /// An empty detail.
    pub const fn new() -> Self {
        Detail {
            buf: [0; DETAIL_MAX],
            len: 0,
        }
    }

    /// A detail formatted from `args`.
    pub fn fmt(args: fmt::Arguments<'_>) -> Self {
        let mut d = Self::new();
        let _ = fmt::write(&mut d, args);
        d
    }

    /// The text so far.
    pub fn as_str(&self) -> &str {
        // Only whole UTF-8 sequences are ever appended (see write_str).
        core::str::from_utf8(&self.buf[..self.len]).unwrap_or("")
    }
}

impl Default for Detail {
    fn default() -> Self {
        Self::new()
    }
}

impl fmt::Write for Detail {
    fn write_str(&mut self, s: &str) -> fmt::Result {
        let room = DETAIL_MAX - self.len;
        let mut take = s.len().min(room);
        while !s.is_char_boundary(take) {
            take -= 1;
        }
        // Report lines are single lines: newlines in details become spaces.
        for (dst, src) in self.buf[self.len..self.len + take]
            .iter_mut()
            .zip(s.bytes())
        {
            *dst = if src == b'\n' || src == b'\r' {
                b' '
            } else {
                src
            };
        }
        self.len += take;
        Ok(())
    }
}

/// Prints `TVMTEST <name> PASS <detail>`.
pub fn pass(name: &str, detail: &Detail) {
    crate::println!("TVMTEST {} PASS {}", name, detail.as_str());
}

/// Prints `TVMTEST <name> FAIL <reason>`.
pub fn fail(name: &str, reason: &Detail) {
    crate::println!("TVMTEST {} FAIL {}", name, reason.as_str());
}

#[cfg(test)]
mod tests {
    use super::*;
    use core::fmt::Write;

    #[test]
    fn detail_truncates_and_flattens_newlines() {
        let mut d = Detail::new();
        write!(d, "a\nb").unwrap();
        assert_eq!(d.as_str(), "a b");
        for _ in 0..100 {
            write!(d, "0123456789").unwrap();
        }
        assert_eq!(d.as_str().len(), DETAIL_MAX);
    }
}
