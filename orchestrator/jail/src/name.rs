//! The tenant name rule, in its one home: `[a-z0-9][a-z0-9-]{0,62}`. A name reaches file
//! paths, cgroup directories, log file names, receipt ids and URLs. The jail checks the
//! `&str` names it receives with it; `tenantvm::domain::TenantName` is built only through
//! it.

/// Longest tenant name, in bytes.
pub const MAX_TENANT_NAME: usize = 63;

/// Whether `name` is a valid tenant name: 1 to [`MAX_TENANT_NAME`] bytes of lower-case
/// ASCII letters, digits and `-`, not starting with `-`.
pub fn is_valid_tenant_name(name: &str) -> bool {
    let bytes = name.as_bytes();
    let first_ok = bytes
        .first()
        .is_some_and(|b| b.is_ascii_lowercase() || b.is_ascii_digit());
    first_ok
        && bytes.len() <= MAX_TENANT_NAME
        && bytes
            .iter()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || *b == b'-')
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_rule() {
        for good in ["a", "0", "alice-2", "9-lives", "a-", &"a".repeat(63)] {
            assert!(is_valid_tenant_name(good), "{good:?}");
        }
        for bad in [
            "",
            "-a",
            "A",
            "a_b",
            "a.b",
            "a/b",
            "..",
            "ä",
            "a\0",
            &"a".repeat(64),
        ] {
            assert!(!is_valid_tenant_name(bad), "{bad:?}");
        }
    }
}
