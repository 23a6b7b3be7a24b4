//! The guests' report lines: `TVMTEST <name> PASS <detail>`, `TVMTEST <name> FAIL <reason>`
//! and, from the panic handler, `TVMTEST <name> PANIC <message>`.

/// What a test reported.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Verdict {
    /// `PASS`.
    Pass,
    /// `FAIL`.
    Fail,
    /// `PANIC` (the guest's panic handler).
    Panic,
}

/// A parsed report line.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Report {
    /// PASS, FAIL or PANIC.
    pub verdict: Verdict,
    /// The rest of the line.
    pub detail: String,
}

impl Report {
    /// The value of `key=value` in the detail, if present.
    pub fn field(&self, key: &str) -> Option<&str> {
        self.detail
            .split_ascii_whitespace()
            .find_map(|w| w.strip_prefix(key).and_then(|r| r.strip_prefix('=')))
    }
}

/// Why no report was found.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum ReportError {
    /// No `TVMTEST <name> PASS|FAIL|PANIC` line in the output.
    #[error("No TVMTEST {test} PASS/FAIL/PANIC line in the serial output:\n{serial}")]
    Missing {
        /// The test name looked for.
        test: String,
        /// The whole serial output.
        serial: String,
    },
}

/// Finds the first `TVMTEST <test> PASS|FAIL|PANIC` line in `serial`.
pub fn parse_report(serial: &str, test: &str) -> Result<Report, ReportError> {
    for line in serial.lines() {
        let line = line.trim_end_matches('\r');
        let mut words = line.splitn(4, ' ');
        if words.next() != Some("TVMTEST") || words.next() != Some(test) {
            continue;
        }
        let verdict = match words.next() {
            Some("PASS") => Verdict::Pass,
            Some("FAIL") => Verdict::Fail,
            Some("PANIC") => Verdict::Panic,
            _ => continue,
        };
        return Ok(Report {
            verdict,
            detail: words.next().unwrap_or("").to_string(),
        });
    }
    Err(ReportError::Missing {
        test: test.to_string(),
        serial: serial.to_string(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn finds_the_named_tests_line_and_skips_others() {
        let serial = "tvm-testguest: entry=pvh\r\nTVMTEST smp READY x\r\nTVMTEST memory PASS no\r\nTVMTEST smp PASS cpus=2 apic_ids=0,1\r\n";
        let r = parse_report(serial, "smp").unwrap();
        assert_eq!(r.verdict, Verdict::Pass);
        assert_eq!(r.field("cpus"), Some("2"));
        assert_eq!(r.field("apic_ids"), Some("0,1"));
        assert_eq!(r.field("nope"), None);
    }

    #[test]
    fn fail_and_panic_lines_are_reported_as_such() {
        assert_eq!(
            parse_report("TVMTEST a FAIL why\n", "a").unwrap().verdict,
            Verdict::Fail
        );
        assert_eq!(
            parse_report("TVMTEST a PANIC boom\n", "a").unwrap().detail,
            "boom"
        );
    }

    #[test]
    fn missing_line_is_an_error_carrying_the_output() {
        let err = parse_report("garbage\n", "smp").unwrap_err();
        assert!(err.to_string().contains("garbage"));
    }
}
