//! The VM's UUID. NVIDIA's vGPU manager finds the VM a vGPU belongs to by reading the UUID
//! from the VMM's command line (QEMU's `-uuid`; tenantvm-vmm's `--uuid`): without it the
//! manager refuses the VM ("Failed to get VM UUID from QEMU command-line"). The daemon makes
//! one per tenant with [`VmUuid::generate`], records it with the tenant (it must survive a
//! restart: the same VM keeps the same UUID), and passes it to the VMM. mdev vGPUs are named
//! by a UUID too ([`super::mdev`]).

use serde::{Deserialize, Serialize};
use thiserror::Error;

/// A malformed UUID.
#[derive(Debug, Clone, Error, PartialEq, Eq)]
#[error("`{0}` is not a UUID: use 36 characters, 8-4-4-4-12 hex digits")]
pub struct UuidError(String);

/// A UUID as the kernel and the VMMs write it: lower-case 8-4-4-4-12 hex.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(try_from = "String", into = "String")]
pub struct VmUuid(String);

impl VmUuid {
    /// A fresh random (version 4) UUID from the OS random source.
    pub fn generate() -> Self {
        VmUuid(uuid::Uuid::new_v4().hyphenated().to_string())
    }

    /// Checks the form (any version); upper-case digits are accepted and lowered.
    pub fn parse(s: &str) -> Result<Self, UuidError> {
        // Only the hyphenated 36-character form: uuid's parser alone would also take the
        // simple, braced and URN forms, which the kernel and the VMMs never write.
        match uuid::Uuid::try_parse(s) {
            Ok(u) if s.len() == 36 => Ok(VmUuid(u.hyphenated().to_string())),
            _ => Err(UuidError(s.to_string())),
        }
    }

    /// The UUID as text.
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl std::fmt::Display for VmUuid {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

impl TryFrom<String> for VmUuid {
    type Error = UuidError;
    fn try_from(s: String) -> Result<Self, UuidError> {
        VmUuid::parse(&s)
    }
}

impl From<VmUuid> for String {
    fn from(u: VmUuid) -> String {
        u.0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn generated_uuids_are_version_4_and_distinct() {
        let u = VmUuid::generate();
        assert_eq!(u.as_str().len(), 36);
        assert_eq!(&u.as_str()[14..15], "4");
        assert!("89ab".contains(&u.as_str()[19..20]));
        assert_ne!(u, VmUuid::generate());
        assert_eq!(VmUuid::parse(u.as_str()).unwrap(), u);
    }

    #[test]
    fn malformed_uuids_are_refused_and_serde_checks_them() {
        for bad in [
            "",
            "../../x",
            "12345678-1234-1234-1234-12345678901",
            "g2345678-1234-1234-1234-123456789012",
        ] {
            assert!(VmUuid::parse(bad).is_err(), "{bad}");
        }
        let u = VmUuid::parse("12345678-9ABC-DEF0-1234-56789abcdef0").unwrap();
        assert_eq!(u.as_str(), "12345678-9abc-def0-1234-56789abcdef0");
        let json = serde_json::to_string(&u).unwrap();
        assert_eq!(serde_json::from_str::<VmUuid>(&json).unwrap(), u);
        serde_json::from_str::<VmUuid>("\"nope\"").unwrap_err();
    }
}
