//! A `Tenant`'s name on its host: `<name>-<the first 8 hex digits of its uid>`. Two client
//! namespaces may both hold an `alice`, and a `Tenant` deleted and made again is a new
//! tenant with a receipt of its own; the host's name rule (`TenantName`) is checked on the
//! whole, so a Kubernetes name the host could not take (dots, upper case, too long) is
//! refused with the rule.

use tenantvm::domain::TenantName;

/// Longest `Tenant` name: the host's 63 less the dash and the 8 digits.
pub const MAX_NAME_LEN: usize = 63 - 9;

/// Why a `Tenant`'s name cannot name a host tenant.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum NameError {
    /// The name breaks the host's rule.
    #[error("Tenant name {name:?} is not a tenantvm tenant name: use 1-{MAX_NAME_LEN} characters from a-z, 0-9 and '-', starting with a letter or digit (no dots, no upper case); the host names it <name>-<8 hex digits of its uid>")]
    Rule {
        /// The name.
        name: String,
    },
    /// The uid has fewer than 8 hex digits (not one the API server made).
    #[error("Tenant uid {0:?} has fewer than 8 hex digits")]
    Uid(String),
}

/// The host name of the `Tenant` `name` with uid `uid`.
pub fn host_name(name: &str, uid: &str) -> Result<TenantName, NameError> {
    let digits: String = uid
        .chars()
        .filter(char::is_ascii_hexdigit)
        .take(8)
        .collect::<String>()
        .to_ascii_lowercase();
    if digits.len() < 8 {
        return Err(NameError::Uid(uid.into()));
    }
    if name.len() > MAX_NAME_LEN {
        return Err(NameError::Rule { name: name.into() });
    }
    TenantName::try_from(format!("{name}-{digits}"))
        .map_err(|_| NameError::Rule { name: name.into() })
}

#[cfg(test)]
mod tests {
    use super::*;

    const UID: &str = "3F2A9C1D-0b7e-4c1a-9d2e-1234567890ab";

    #[test]
    fn a_host_name_is_the_name_and_eight_digits_of_the_uid() {
        assert_eq!(host_name("alice", UID).unwrap().as_str(), "alice-3f2a9c1d");
        let longest = "a".repeat(MAX_NAME_LEN);
        assert_eq!(host_name(&longest, UID).unwrap().as_str().len(), 63);
    }

    #[test]
    fn names_the_host_cannot_take_are_refused_with_the_rule() {
        for bad in ["a.b", "Alice", "-a", "", &"a".repeat(MAX_NAME_LEN + 1)] {
            let e = host_name(bad, UID).unwrap_err();
            assert!(
                e.to_string().contains("not a tenantvm tenant name"),
                "{bad}: {e}"
            );
        }
        assert!(matches!(host_name("a", "zz-1"), Err(NameError::Uid(_))));
    }
}
