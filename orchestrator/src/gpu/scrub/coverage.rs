//! How much of a slice's memory a scrub must cover to count: the one rule, used by the scrub
//! itself, by the daemon on the outcome its child reports, and by `tenantvm verify` (check
//! 10) on a receipt.
//!
//! A scrub allocates all the memory the device will give and zeroes it. What it cannot
//! allocate is what the driver holds when it begins (the device's total less CUDA's free
//! figure, after the scrub's own context exists: the context, page tables, the driver's
//! reservations), plus a little the allocator cannot hand out in the scrub's chunks. So it
//! must cover the slice's memory less what the driver holds, and the outcome states both.
//! A driver holding more than a CUDA context needs means something else holds the slice's
//! memory (a process still on it), memory the scrub never saw: a failed scrub.

/// What the driver may hold at least, whatever the slice's size: a CUDA context with its
/// page tables and the driver's reservations is some hundreds of MiB (no NVIDIA document
/// gives a figure per card; unconfirmed).
pub const HELD_FLOOR_BYTES: u64 = 1 << 30;
/// What the driver may hold on a large slice, in percent of the slice's memory.
pub const HELD_LIMIT_PERCENT: u64 = 5;
/// Memory the scrub's allocator may leave uncovered: twice its smallest chunk (2 MiB, the
/// driver's large-page granularity) ...
pub const SLACK_FLOOR_BYTES: u64 = 4 << 20;
/// ... plus this many thousandths of the slice (fragmentation of the driver's free space).
pub const SLACK_PER_MILLE: u64 = 5;

/// The most a driver may hold of a slice of `total_bytes` when a scrub begins.
pub fn held_limit(total_bytes: u64) -> u64 {
    HELD_FLOOR_BYTES.max(total_bytes / 100 * HELD_LIMIT_PERCENT)
}

/// The uncovered memory allowed for allocation granularity on a slice of `total_bytes`.
pub fn slack(total_bytes: u64) -> u64 {
    SLACK_FLOOR_BYTES + total_bytes / 1000 * SLACK_PER_MILLE
}

/// A scrub's coverage, judged.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Coverage {
    /// The bytes it had to zero: the slice's memory less what the driver held (at most
    /// `cap`, for a scrub capped on request).
    pub required_bytes: u64,
    /// Why it did not cover them, in words; `None` when it did.
    pub shortfall: Option<String>,
}

/// Judges a scrub that zeroed `scrubbed_bytes` of a device of `total_bytes`, whose driver
/// held `held_bytes` when the scrub began; `cap` is a limit asked for (tests, benchmarks;
/// the daemon never sets one).
pub fn judge(total_bytes: u64, held_bytes: u64, scrubbed_bytes: u64, cap: Option<u64>) -> Coverage {
    let mut required_bytes = total_bytes.saturating_sub(held_bytes);
    if let Some(cap) = cap {
        required_bytes = required_bytes.min(cap);
    }
    let shortfall = if total_bytes == 0 {
        Some("the device reports no memory: nothing was known to scrub".to_string())
    } else if held_bytes > held_limit(total_bytes) {
        Some(format!(
            "{held_bytes} of the device's {total_bytes} bytes were held by others when the scrub began, more than the {} a driver's context takes: something else holds the slice's memory (a process still on it?), and the scrub could not reach it",
            held_limit(total_bytes)
        ))
    } else if scrubbed_bytes.saturating_add(slack(total_bytes)) < required_bytes {
        Some(format!(
            "zeroed {scrubbed_bytes} of the {required_bytes} bytes it had to cover (the device's {total_bytes} less the {held_bytes} its driver held): {} bytes were never scrubbed",
            required_bytes - scrubbed_bytes
        ))
    } else {
        None
    };
    Coverage {
        required_bytes,
        shortfall,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const GIB: u64 = 1 << 30;
    const MIB: u64 = 1 << 20;

    #[test]
    fn a_scrub_of_all_but_the_drivers_share_covers_the_slice() {
        // H100 80GB whole: 79.6 GiB, a context of 600 MiB, the allocator 100 MiB short.
        let total = 81_559 * MIB;
        let c = judge(total, 600 * MIB, total - 700 * MIB, None);
        assert_eq!(c.shortfall, None);
        assert_eq!(c.required_bytes, total - 600 * MIB);
        // A 1g.10gb instance: 9.75 GiB, 300 MiB held, all the rest zeroed.
        let c = judge(9_984 * MIB, 300 * MIB, 9_684 * MIB, None);
        assert_eq!(c.shortfall, None);
    }

    #[test]
    fn any_coverage_short_of_the_slice_is_a_shortfall() {
        // Half an H100: the old rule (any coverage above zero) passed it.
        let total = 81_559 * MIB;
        let c = judge(total, 600 * MIB, total / 2, None);
        let why = c.shortfall.unwrap();
        assert!(why.contains("never scrubbed"), "{why}");
        // Just past the allocator's slack.
        let required = total - 600 * MIB;
        let c = judge(total, 600 * MIB, required - slack(total) - 1, None);
        assert!(c.shortfall.is_some());
        let c = judge(total, 600 * MIB, required - slack(total), None);
        assert!(c.shortfall.is_none());
        // Nothing known.
        assert!(judge(0, 0, 0, None).shortfall.is_some());
    }

    #[test]
    fn memory_held_beyond_a_drivers_share_is_a_shortfall() {
        // 20 GiB of an H100 held by something else when the scrub began: the scrub zeroed
        // all it could allocate, and still did not cover the slice.
        let total = 81_559 * MIB;
        let c = judge(total, 20 * GIB, total - 20 * GIB, None);
        assert!(c.shortfall.unwrap().contains("held by others"));
        // A small slice may still have a context's worth held.
        assert!(judge(4_864 * MIB, GIB, 3_840 * MIB, None)
            .shortfall
            .is_none());
        assert!(judge(4_864 * MIB, GIB + 1, 3_840 * MIB, None)
            .shortfall
            .is_some());
    }

    #[test]
    fn a_cap_asked_for_limits_what_must_be_covered() {
        let c = judge(96 * MIB, 4 * MIB, 8 * MIB, Some(8 * MIB));
        assert_eq!((c.required_bytes, c.shortfall), (8 * MIB, None));
    }
}
