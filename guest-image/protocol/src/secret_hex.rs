//! Secrets on the wire as hexadecimal text, decoded and encoded without an unzeroized copy:
//! the one codec of the disk key ([`crate::DiskKey`]) and the vGPU licence token
//! ([`crate::LicenceToken`]).

use serde::{Deserializer, Serializer};
use zeroize::{Zeroize, Zeroizing};

/// Why hex text was not a secret of the accepted length.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum HexError {
    /// It decodes to this many bytes, outside the accepted range.
    Length(usize),
    /// Not hexadecimal with an even number of digits.
    NotHex,
}

/// Decodes `s` into a zeroized buffer of `min..=max` bytes; no other copy is made.
pub(crate) fn decode(s: &str, min: usize, max: usize) -> Result<Zeroizing<Vec<u8>>, HexError> {
    if s.len() % 2 != 0 {
        return Err(HexError::NotHex);
    }
    let n = s.len() / 2;
    if !(min..=max).contains(&n) {
        return Err(HexError::Length(n));
    }
    let mut out = Zeroizing::new(vec![0u8; n]);
    hex::decode_to_slice(s, &mut out).map_err(|_| HexError::NotHex)?;
    Ok(out)
}

/// Serialises `bytes` as lowercase hex through a zeroized buffer.
pub(crate) fn serialize<S: Serializer>(bytes: &[u8], s: S) -> Result<S::Ok, S::Error> {
    let mut digits = Zeroizing::new(vec![0u8; bytes.len() * 2]);
    hex::encode_to_slice(bytes, &mut digits).map_err(serde::ser::Error::custom)?;
    // Hex digits are ASCII, so this never fails.
    let text = std::str::from_utf8(&digits).map_err(serde::ser::Error::custom)?;
    s.serialize_str(text)
}

/// Deserialises hex text with `parse`, zeroizing an owned copy of the text afterwards.
pub(crate) fn deserialize<'de, D, T, E>(
    d: D,
    expecting: &'static str,
    parse: fn(&str) -> Result<T, E>,
) -> Result<T, D::Error>
where
    D: Deserializer<'de>,
    E: std::fmt::Display,
{
    struct HexVisitor<T, E> {
        expecting: &'static str,
        parse: fn(&str) -> Result<T, E>,
    }
    impl<T, E: std::fmt::Display> serde::de::Visitor<'_> for HexVisitor<T, E> {
        type Value = T;
        fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
            f.write_str(self.expecting)
        }
        fn visit_str<Er: serde::de::Error>(self, v: &str) -> Result<T, Er> {
            (self.parse)(v).map_err(Er::custom)
        }
        fn visit_string<Er: serde::de::Error>(self, mut v: String) -> Result<T, Er> {
            let parsed = (self.parse)(&v).map_err(Er::custom);
            v.zeroize();
            parsed
        }
    }
    d.deserialize_str(HexVisitor { expecting, parse })
}
