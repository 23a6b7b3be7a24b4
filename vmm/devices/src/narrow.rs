//! Narrowing integer conversions, one function per meaning.
//!
//! This crate denies `clippy::cast_possible_truncation`: an `as` that drops high bits does
//! so silently, and in a device model the value is often the guest's. Each narrowing says
//! which of these it is:
//!
//! - the low bits on purpose ([`low_u8`], [`low_u16`], [`low_u32`]): a guest access wider
//!   than the register it lands in keeps the register's bytes, as the hardware does, and a
//!   64-bit value split into dwords keeps each half, a counter that wraps at 2^32 takes
//!   a count modulo 2^32;
//! - a constant known to fit ([`const_u8`], [`const_u16`], [`const_u32`]): checked when the
//!   constant is evaluated, so used in `const` items or `const { }` blocks it fails the
//!   build, never the guest;
//! - anything else (a length, an index, an offset that fits because of a check elsewhere)
//!   uses `try_from` at the site and handles the error there.
//!
//! The low-bits helpers slice `to_le_bytes()` rather than cast, so that "which bytes" is
//! spelled out.

/// The low byte of `value`: a register one byte wide written with a wider value.
pub(crate) const fn low_u8(value: u64) -> u8 {
    value.to_le_bytes()[0]
}

/// The low two bytes of `value`: a 16-bit register written with a wider value.
pub(crate) const fn low_u16(value: u64) -> u16 {
    let b = value.to_le_bytes();
    u16::from_le_bytes([b[0], b[1]])
}

/// The low four bytes of `value`: a 32-bit register written with a wider value, the low
/// dword of a 64-bit one, or a count added to a counter that wraps at 2^32.
pub(crate) const fn low_u32(value: u64) -> u32 {
    let b = value.to_le_bytes();
    u32::from_le_bytes([b[0], b[1], b[2], b[3]])
}

/// A constant as a `u8`; panics (at compile time in a `const` context) if it does not fit.
pub(crate) const fn const_u8(value: u64) -> u8 {
    assert!(value <= u8::MAX as u64, "constant does not fit in a u8");
    low_u8(value)
}

/// A constant as a `u16`; panics (at compile time in a `const` context) if it does not fit.
pub(crate) const fn const_u16(value: u64) -> u16 {
    assert!(value <= u16::MAX as u64, "constant does not fit in a u16");
    low_u16(value)
}

/// A constant as a `u32`; panics (at compile time in a `const` context) if it does not fit.
pub(crate) const fn const_u32(value: u64) -> u32 {
    assert!(value <= u32::MAX as u64, "constant does not fit in a u32");
    low_u32(value)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn low_bits_keep_the_low_bytes() {
        let v = 0x1122_3344_5566_7788_u64;
        assert_eq!(low_u8(v), 0x88);
        assert_eq!(low_u16(v), 0x7788);
        assert_eq!(low_u32(v), 0x5566_7788);
        // The same as the casts they replace, on values at every byte boundary.
        for v in [
            0,
            1,
            0xff,
            0x100,
            0xffff,
            0x1_0000,
            u64::from(u32::MAX),
            u64::MAX,
        ] {
            assert_eq!(low_u8(v), v.to_le_bytes()[0]);
            assert_eq!(u64::from(low_u16(v)), v & 0xffff);
            assert_eq!(u64::from(low_u32(v)), v & 0xffff_ffff);
        }
    }

    #[test]
    fn constants_that_fit_convert() {
        assert_eq!(const { const_u8(255) }, 255);
        assert_eq!(const { const_u16(0xffff) }, 0xffff);
        assert_eq!(const { const_u32(0xffff_ffff) }, 0xffff_ffff);
    }

    #[test]
    #[should_panic(expected = "does not fit in a u8")]
    fn a_constant_too_wide_for_a_u8_panics() {
        let v = std::hint::black_box(256);
        const_u8(v);
    }

    #[test]
    #[should_panic(expected = "does not fit in a u16")]
    fn a_constant_too_wide_for_a_u16_panics() {
        const_u16(std::hint::black_box(0x1_0000));
    }

    #[test]
    #[should_panic(expected = "does not fit in a u32")]
    fn a_constant_too_wide_for_a_u32_panics() {
        const_u32(std::hint::black_box(1 << 32));
    }
}
