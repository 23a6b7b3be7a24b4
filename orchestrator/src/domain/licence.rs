//! A tenant's NVIDIA vGPU licence as the operator gives it in the spec
//! (`vgpu_licence`): the text of the client configuration token
//! (`client_configuration_token_*.tok`) that NVIDIA's licensing client in the guest reads.
//!
//! Write-only: the value is read from the create request, never written back out. The
//! service takes it out of the spec before anything is stored (docs/gpu.md, "The tenant's
//! guest side of a vGPU"), so the stored spec, the API's answers, events and receipts
//! never hold it; `Debug` shows only its length.

use std::fmt;

use serde::{Deserialize, Deserializer, Serialize, Serializer};
use zeroize::{Zeroize, Zeroizing};

/// Longest token accepted, bytes (what the guest protocol carries).
pub const MAX_VGPU_LICENCE_BYTES: usize = tenantvm_agent_protocol::MAX_LICENCE_LEN;

/// The token's text, zeroized on drop, never printed.
#[derive(Clone, PartialEq, Eq)]
pub struct VgpuLicence(Zeroizing<String>);

impl VgpuLicence {
    /// The token; refuses an empty one or one over [`MAX_VGPU_LICENCE_BYTES`]. The error
    /// never quotes the text.
    pub fn new(text: &str) -> Result<Self, String> {
        if text.trim().is_empty() || text.len() > MAX_VGPU_LICENCE_BYTES {
            return Err(format!(
                "vgpu_licence holds {} bytes: give the contents of NVIDIA's client configuration token (1 to {MAX_VGPU_LICENCE_BYTES} bytes)",
                text.len()
            ));
        }
        Ok(Self(Zeroizing::new(text.to_string())))
    }

    /// The token's bytes. Never log, store or show them.
    pub fn expose(&self) -> &[u8] {
        self.0.as_bytes()
    }
}

impl fmt::Debug for VgpuLicence {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "VgpuLicence(<{} bytes redacted>)", self.0.len())
    }
}

/// Serialised as its text, so that a client (the CLI) can send it in a create request; the
/// daemon never serialises one (the service removes it from the spec first).
impl Serialize for VgpuLicence {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(&self.0)
    }
}

impl<'de> Deserialize<'de> for VgpuLicence {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let mut text = String::deserialize(d)?;
        let token = VgpuLicence::new(&text).map_err(serde::de::Error::custom);
        text.zeroize();
        token
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_token_is_never_shown_and_bad_ones_are_refused_without_quoting_them() {
        let t = VgpuLicence::new("secret-token-text").unwrap();
        assert!(!format!("{t:?}").contains("secret-token"));
        for bad in ["", "  \n", &"x".repeat(MAX_VGPU_LICENCE_BYTES + 1)] {
            let err = VgpuLicence::new(bad).unwrap_err();
            assert!(err.contains("client configuration token"), "{err}");
            assert!(!err.contains("xxxx"), "{err}");
        }
        let json: VgpuLicence = serde_json::from_str(r#""abc.def""#).unwrap();
        assert_eq!(json.expose(), b"abc.def");
        serde_json::from_str::<VgpuLicence>("7").unwrap_err();
    }
}
