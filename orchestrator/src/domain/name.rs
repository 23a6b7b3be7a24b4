//! The tenant name: the one rule every layer relies on.
//!
//! A tenant's name reaches file paths (`<state>/tenants/<name>`, `keys/<name>.key`), cgroup
//! directories, log file names, receipt ids and URLs, so it is held to
//! `[a-z0-9][a-z0-9-]{0,62}`: lower-case ASCII letters, digits and `-`, not starting with
//! `-`, 1 to 63 bytes. A [`TenantName`] can only be built through that check (parsing,
//! `TryFrom`, or serde), so code that holds one never checks again; code that receives a
//! plain string at a boundary (a path segment, a directory listing, another module's
//! `&str` API) checks it with [`TenantName::check`], the same rule. The rule itself lives
//! in the jail crate ([`tenantvm_jail::name`]), which checks the names it is given and
//! cannot depend on this crate; this type is the only way to build a name here.

use std::borrow::Borrow;
use std::fmt;
use std::ops::Deref;
use std::str::FromStr;

use serde::{Deserialize, Serialize};
use thiserror::Error;

/// Longest tenant name, in bytes (the rule lives with the jail, which checks the names it
/// is given: [`tenantvm_jail::name`]).
pub use tenantvm_jail::MAX_TENANT_NAME;

/// A string that is not a valid tenant name.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
#[error("Invalid tenant name {0:?}: use 1-63 characters from a-z, 0-9 and '-', starting with a letter or digit")]
pub struct InvalidTenantName(pub String);

/// A validated tenant name (`[a-z0-9][a-z0-9-]{0,62}`).
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(try_from = "String", into = "String")]
pub struct TenantName(String);

impl TenantName {
    /// Checks `name` against the rule without keeping it.
    pub fn check(name: &str) -> Result<(), InvalidTenantName> {
        if tenantvm_jail::is_valid_tenant_name(name) {
            Ok(())
        } else {
            Err(InvalidTenantName(name.to_string()))
        }
    }

    /// Validates `name`.
    pub fn new(name: impl Into<String>) -> Result<TenantName, InvalidTenantName> {
        let name = name.into();
        Self::check(&name)?;
        Ok(TenantName(name))
    }

    /// The name as a string slice.
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl FromStr for TenantName {
    type Err = InvalidTenantName;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        TenantName::new(s)
    }
}

impl TryFrom<String> for TenantName {
    type Error = InvalidTenantName;

    fn try_from(s: String) -> Result<Self, Self::Error> {
        TenantName::new(s)
    }
}

impl TryFrom<&str> for TenantName {
    type Error = InvalidTenantName;

    fn try_from(s: &str) -> Result<Self, Self::Error> {
        TenantName::new(s)
    }
}

impl From<TenantName> for String {
    fn from(n: TenantName) -> String {
        n.0
    }
}

impl Deref for TenantName {
    type Target = str;

    fn deref(&self) -> &str {
        &self.0
    }
}

impl AsRef<str> for TenantName {
    fn as_ref(&self) -> &str {
        &self.0
    }
}

impl AsRef<std::path::Path> for TenantName {
    fn as_ref(&self) -> &std::path::Path {
        std::path::Path::new(&self.0)
    }
}

impl Borrow<str> for TenantName {
    fn borrow(&self) -> &str {
        &self.0
    }
}

impl fmt::Display for TenantName {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl PartialEq<str> for TenantName {
    fn eq(&self, other: &str) -> bool {
        self.0 == other
    }
}

impl PartialEq<&str> for TenantName {
    fn eq(&self, other: &&str) -> bool {
        self.0 == *other
    }
}

impl PartialEq<String> for TenantName {
    fn eq(&self, other: &String) -> bool {
        &self.0 == other
    }
}

impl PartialEq<TenantName> for String {
    fn eq(&self, other: &TenantName) -> bool {
        *self == other.0
    }
}

impl PartialEq<TenantName> for str {
    fn eq(&self, other: &TenantName) -> bool {
        self == other.0
    }
}

impl PartialEq<TenantName> for &str {
    fn eq(&self, other: &TenantName) -> bool {
        *self == other.0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Names that would escape a directory, collide with another after case folding, or
    /// break a path, a cgroup or a log line: every one is refused, by every way in.
    const HOSTILE: &[&str] = &[
        "",
        "../x",
        "..",
        ".",
        "a/b",
        "/abs",
        "a\\b",
        "-a",
        "-",
        "Alice",
        "A",
        "a_b",
        "a.b",
        "a b",
        " a",
        "a\n",
        "a\0",
        "\0",
        "ä",
        "a\u{200b}b",
        "ａ",
        "\u{1b}[31m",
    ];

    #[test]
    fn good_names_parse() {
        for good in ["a", "0", "alice-2", "9-lives", "a-", &"a".repeat(63)] {
            let n: TenantName = good.parse().unwrap();
            assert_eq!(n.as_str(), good);
            assert_eq!(n.to_string(), good);
        }
    }

    #[test]
    fn hostile_names_are_refused_by_every_constructor() {
        let long = "a".repeat(64);
        let longer = "a".repeat(4096);
        for bad in HOSTILE
            .iter()
            .copied()
            .chain([long.as_str(), longer.as_str()])
        {
            assert!(TenantName::check(bad).is_err(), "check {bad:?}");
            assert!(bad.parse::<TenantName>().is_err(), "parse {bad:?}");
            assert!(TenantName::try_from(bad).is_err(), "try_from {bad:?}");
            assert!(
                TenantName::try_from(bad.to_string()).is_err(),
                "try_from String {bad:?}"
            );
            let json = serde_json::to_string(bad).unwrap();
            assert!(
                serde_json::from_str::<TenantName>(&json).is_err(),
                "serde {bad:?}"
            );
        }
    }

    #[test]
    fn the_error_names_the_rule_and_quotes_the_input_escaped() {
        let err = TenantName::new("a\u{1b}[2J\0").unwrap_err().to_string();
        assert!(err.contains("Invalid tenant name"), "{err}");
        assert!(err.contains("a-z, 0-9 and '-'"), "{err}");
        // Debug quoting: no raw escape or NUL reaches a terminal through the message.
        assert!(!err.contains('\u{1b}') && !err.contains('\0'), "{err:?}");
    }

    #[test]
    fn serde_round_trips_as_a_plain_string() {
        let n = TenantName::new("bob-1").unwrap();
        let json = serde_json::to_string(&n).unwrap();
        assert_eq!(json, "\"bob-1\"");
        assert_eq!(serde_json::from_str::<TenantName>(&json).unwrap(), n);
    }
}
