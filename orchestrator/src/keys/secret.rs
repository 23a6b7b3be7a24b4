//! Secret byte buffers: zeroized on drop, locked in memory where the kernel allows it, and never
//! printed.

use std::fmt;

use zeroize::Zeroize;

/// A fixed-size secret held in its own heap allocation.
///
/// The bytes are locked into RAM (best effort: `mlock` may be refused under a low
/// `RLIMIT_MEMLOCK`), overwritten with zeroes when the value is dropped, and never shown by
/// `Debug` (which prints only the length). There is no `Display`, `Clone`, `Serialize` or
/// `PartialEq`: the only way to the bytes is [`Secret::expose`], so every use is greppable.
pub struct Secret<const N: usize> {
    bytes: Box<[u8; N]>,
    locked: bool,
}

impl<const N: usize> Secret<N> {
    /// A secret of zeroes, to be filled in place (so the bytes never live on the stack).
    pub(crate) fn zeroed() -> Self {
        let mut bytes = Box::new([0u8; N]);
        let ptr = bytes.as_mut_ptr();
        // SAFETY: `ptr` points at N bytes owned by `bytes`, which stays allocated (and at the
        // same address) until `Drop` unlocks it. mlock has no other effect on memory safety.
        let locked = unsafe { libc::mlock(ptr.cast(), N) } == 0;
        Secret { bytes, locked }
    }

    /// A secret filled from the operating system's random number generator.
    pub fn random() -> Result<Self, rand::rand_core::OsError> {
        use rand::TryRngCore;
        let mut secret = Self::zeroed();
        rand::rngs::OsRng.try_fill_bytes(secret.bytes.as_mut_slice())?;
        Ok(secret)
    }

    /// A secret copied from `source`; the caller zeroizes its own copy.
    pub(crate) fn from_slice(source: &[u8]) -> Option<Self> {
        if source.len() != N {
            return None;
        }
        let mut secret = Self::zeroed();
        secret.bytes.copy_from_slice(source);
        Some(secret)
    }

    /// The secret bytes. Callers must not copy them anywhere that outlives the call.
    pub fn expose(&self) -> &[u8; N] {
        &self.bytes
    }

    /// Mutable access for filling the secret in place (tests).
    #[cfg(test)]
    pub(crate) fn expose_mut(&mut self) -> &mut [u8; N] {
        &mut self.bytes
    }
}

impl<const N: usize> Drop for Secret<N> {
    fn drop(&mut self) {
        self.bytes.zeroize();
        if self.locked {
            let ptr = self.bytes.as_mut_ptr();
            // SAFETY: the same N-byte allocation that `zeroed` locked; it is still alive.
            unsafe { libc::munlock(ptr.cast(), N) };
        }
    }
}

impl<const N: usize> fmt::Debug for Secret<N> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Secret<{N} bytes, redacted>")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn debug_output_shows_no_key_bytes() {
        let mut secret = Secret::<64>::zeroed();
        secret.expose_mut().fill(0xAB);
        let shown = format!("{secret:?} {secret:#?}");
        assert!(!shown.contains("ab") && !shown.contains("AB") && !shown.contains("171"));
        assert!(shown.contains("redacted"));
    }

    #[test]
    fn random_secrets_differ_and_are_not_zero() {
        let a = Secret::<64>::random().unwrap();
        let b = Secret::<64>::random().unwrap();
        assert_ne!(a.expose(), b.expose());
        assert_ne!(a.expose(), &[0u8; 64]);
    }

    #[test]
    fn from_slice_rejects_wrong_length() {
        assert!(Secret::<32>::from_slice(&[1u8; 31]).is_none());
        assert_eq!(
            Secret::<32>::from_slice(&[1u8; 32]).unwrap().expose(),
            &[1u8; 32]
        );
    }
}
