//! The tenant's NVIDIA vGPU licence: the client configuration token of NVIDIA's licensing
//! client (`nvidia-gridd`, part of the vGPU guest driver), delivered like the disk key
//! ([`crate::Request::InstallLicence`]) and written where that client reads it.
//!
//! NVIDIA's Virtual GPU Client Licensing User Guide ("Configuring a Licensed Client on
//! Linux"): copy the token into `/etc/nvidia/ClientConfigToken`, with file access modes
//! that let the owner read, write and execute it and the group and others only read it
//! (`chmod 744`), then (re)start `nvidia-gridd`. The agent writes it there before the
//! payload starts; the token lives in the guest's RAM (the initramfs root), never on the
//! tenant's disk.

use std::fmt;

use serde::{Deserialize, Deserializer, Serialize, Serializer};
use thiserror::Error;
use zeroize::Zeroizing;

/// Where NVIDIA's licensing client reads client configuration tokens in a Linux guest.
pub const LICENCE_DIR: &str = "/etc/nvidia/ClientConfigToken";
/// The file the agent writes in [`LICENCE_DIR`] (the client reads every `*.tok` there).
pub const LICENCE_FILE: &str = "client_configuration_token_tenantvm.tok";
/// The token file's mode, as NVIDIA's guide asks (`chmod 744`).
pub const LICENCE_FILE_MODE: u32 = 0o744;
/// The mode of [`LICENCE_DIR`] when the agent creates it.
pub const LICENCE_DIR_MODE: u32 = 0o755;
/// Longest accepted token, bytes (NVIDIA's tokens are a few KiB of text).
pub const MAX_LICENCE_LEN: usize = 64 * 1024;

/// A vGPU licence token: raw bytes (the `.tok` file's contents), hex on the wire, zeroized
/// on drop, never printed.
#[derive(Clone, PartialEq, Eq)]
pub struct LicenceToken(Zeroizing<Vec<u8>>);

/// Why a licence token was refused.
#[derive(Debug, Error, PartialEq, Eq)]
pub enum LicenceError {
    /// Empty or too long.
    #[error("The vGPU licence token is {0} bytes; it must be 1 to {MAX_LICENCE_LEN} bytes (the contents of NVIDIA's client_configuration_token_*.tok file)")]
    Length(usize),
    /// Not hexadecimal on the wire.
    #[error("The vGPU licence token is not hexadecimal with an even number of digits")]
    NotHex,
}

impl LicenceToken {
    /// Wraps the token's bytes; refuses an empty one or one over [`MAX_LICENCE_LEN`].
    pub fn new(bytes: &[u8]) -> Result<Self, LicenceError> {
        if !(1..=MAX_LICENCE_LEN).contains(&bytes.len()) {
            return Err(LicenceError::Length(bytes.len()));
        }
        Ok(Self(Zeroizing::new(bytes.to_vec())))
    }

    /// The token's bytes.
    pub fn expose(&self) -> &[u8] {
        &self.0
    }
}

impl fmt::Debug for LicenceToken {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "LicenceToken(<{} bytes redacted>)", self.0.len())
    }
}

fn token_from_hex(s: &str) -> Result<LicenceToken, LicenceError> {
    crate::secret_hex::decode(s, 1, MAX_LICENCE_LEN)
        .map(LicenceToken)
        .map_err(|e| match e {
            crate::secret_hex::HexError::Length(n) => LicenceError::Length(n),
            crate::secret_hex::HexError::NotHex => LicenceError::NotHex,
        })
}

impl Serialize for LicenceToken {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        crate::secret_hex::serialize(&self.0, s)
    }
}

impl<'de> Deserialize<'de> for LicenceToken {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        crate::secret_hex::deserialize(d, "a hexadecimal vGPU licence token", token_from_hex)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::frame::{decode_body, encode_frame, HEADER_LEN};
    use crate::message::{Request, RequestFrame};

    const TOKEN: &[u8] = b"eyJhbGciOiJSUzI1NiJ9.tenantvm-test-licence.c2lnbmF0dXJl\n";

    #[test]
    fn the_token_travels_as_hex_and_debug_redacts_it() {
        let token = LicenceToken::new(TOKEN).unwrap();
        let req = RequestFrame {
            id: 7,
            request: Request::InstallLicence {
                token: token.clone(),
            },
        };
        let bytes = encode_frame(&req).unwrap();
        let body = String::from_utf8_lossy(&bytes[HEADER_LEN..]).to_string();
        assert!(body.contains(r#""cmd":"install-licence""#), "{body}");
        assert!(body.contains(&hex::encode(TOKEN)), "{body}");
        // The text itself never travels: only its hex digits.
        assert!(!body.contains("tenantvm-test-licence"), "{body}");
        let back: RequestFrame = decode_body(&bytes[HEADER_LEN..]).unwrap();
        assert_eq!(back, req);
        let shown = format!("{back:?}");
        assert!(!shown.contains(&hex::encode(TOKEN)), "{shown}");
        assert!(shown.contains("redacted"), "{shown}");
    }

    #[test]
    fn hostile_install_licence_frames_are_refused() {
        let long = "ab".repeat(MAX_LICENCE_LEN + 1);
        let cases = [
            r#"{"id":1,"request":{"cmd":"install-licence","token":""}}"#.to_string(),
            r#"{"id":1,"request":{"cmd":"install-licence","token":"zz"}}"#.to_string(),
            r#"{"id":1,"request":{"cmd":"install-licence","token":"abc"}}"#.to_string(),
            r#"{"id":1,"request":{"cmd":"install-licence","token":7}}"#.to_string(),
            r#"{"id":1,"request":{"cmd":"install-licence","token":["ab"]}}"#.to_string(),
            r#"{"id":1,"request":{"cmd":"install-licence"}}"#.to_string(),
            r#"{"id":1,"request":{"cmd":"install-licence","token":"abab","path":"/etc/shadow"}}"#
                .to_string(),
            format!(r#"{{"id":1,"request":{{"cmd":"install-licence","token":"{long}"}}}}"#),
        ];
        for body in &cases {
            assert!(
                decode_body::<RequestFrame>(body.as_bytes()).is_err(),
                "{}",
                &body[..body.len().min(120)]
            );
        }
        // The control: the same frame with a good token decodes.
        let good = r#"{"id":1,"request":{"cmd":"install-licence","token":"abab"}}"#;
        decode_body::<RequestFrame>(good.as_bytes()).unwrap();
        assert_eq!(LicenceToken::new(b"").unwrap_err(), LicenceError::Length(0));
        assert_eq!(
            LicenceToken::new(&vec![b'a'; MAX_LICENCE_LEN + 1]).unwrap_err(),
            LicenceError::Length(MAX_LICENCE_LEN + 1)
        );
        LicenceToken::new(&vec![b'a'; MAX_LICENCE_LEN]).unwrap();
    }
}
