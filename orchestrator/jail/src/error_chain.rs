//! An error and its causes on one line, for the messages people read (the daemon's events,
//! the jail's own failure line). Written once for the whole orchestrator: the jail uses it
//! here, the daemon through its re-export of this crate.

/// `e` and each of its sources, joined by `": "`. A source whose text the line already
/// holds (an error that prints its cause in its own message and also returns it as its
/// source) is not printed a second time; its own sources still are.
pub fn error_chain(e: &dyn std::error::Error) -> String {
    let mut text = e.to_string();
    let mut cur = e.source();
    while let Some(cause) = cur {
        let said = cause.to_string();
        if !said.is_empty() && !text.contains(&said) {
            text.push_str(": ");
            text.push_str(&said);
        }
        cur = cause.source();
    }
    text
}

#[cfg(test)]
mod tests {
    use super::*;

    /// An error with one cause, printing it in its own message or not.
    #[derive(Debug)]
    struct Outer {
        cause: std::io::Error,
        says_cause: bool,
    }

    impl std::fmt::Display for Outer {
        fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
            if self.says_cause {
                write!(f, "cannot open the tap: {}", self.cause)
            } else {
                write!(f, "cannot open the tap")
            }
        }
    }

    impl std::error::Error for Outer {
        fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
            Some(&self.cause)
        }
    }

    fn outer(says_cause: bool) -> Outer {
        Outer {
            cause: std::io::Error::other("permission denied"),
            says_cause,
        }
    }

    #[test]
    fn a_cause_is_printed_once_whether_or_not_the_message_holds_it() {
        assert_eq!(
            error_chain(&outer(false)),
            "cannot open the tap: permission denied"
        );
        assert_eq!(
            error_chain(&outer(true)),
            "cannot open the tap: permission denied"
        );
    }

    #[test]
    fn an_error_without_sources_is_its_message() {
        assert_eq!(
            error_chain(&std::io::Error::other("no such file")),
            "no such file"
        );
    }
}
