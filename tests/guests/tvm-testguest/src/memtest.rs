//! The `memory` test: write a pattern over every usable RAM byte of the memory map that the
//! guest image does not occupy, then read it all back. Each 4 KiB page gets its own word
//! (a function of the page address and a per-run seed), so a page mapped twice, or mapped to
//! the wrong host page, or not retaining writes, shows up as a mismatch.

use crate::bootinfo::{BootInfo, MemRegion, MEMMAP_MAX, MEM_TYPE_RAM};
use crate::report::Detail;
use core::fmt::Write;

/// Multiplier of the pattern (the golden-ratio constant: neighbouring words differ a lot).
const PATTERN_MUL: u64 = 0x9e37_79b9_7f4a_7c15;

/// A range to test, `[start, end)`, 8-byte aligned.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Span {
    /// First byte.
    pub start: u64,
    /// One past the last byte.
    pub end: u64,
}

/// The spans to test: RAM entries minus `exclude`, aligned inwards to 8 bytes. Returns the
/// spans and the number of RAM bytes left out by alignment.
pub fn spans(regions: &[MemRegion], exclude: Span) -> ([Span; 2 * MEMMAP_MAX], usize, u64) {
    let mut out = [Span::default(); 2 * MEMMAP_MAX];
    let mut n = 0;
    let mut unaligned = 0;
    for r in regions
        .iter()
        .filter(|r| r.kind == MEM_TYPE_RAM && r.len > 0)
    {
        let (s, e) = (r.start, r.end());
        let pieces = [(s, e.min(exclude.start)), (s.max(exclude.end), e)];
        for (ps, pe) in pieces {
            if ps >= pe {
                continue;
            }
            let (a, b) = ((ps + 7) & !7, pe & !7);
            if a >= b {
                unaligned += pe - ps;
                continue;
            }
            unaligned += (a - ps) + (pe - b);
            out[n] = Span { start: a, end: b };
            n += 1;
        }
    }
    (out, n, unaligned)
}

/// The pattern word stored at `addr` for `seed`.
pub fn pattern(addr: u64, seed: u64) -> u64 {
    addr.wrapping_mul(PATTERN_MUL) ^ seed
}

/// Calls `f` for each piece of `span` that lies within one 4 KiB page.
fn per_page(span: Span, mut f: impl FnMut(u64, u64) -> bool) {
    let mut at = span.start;
    while at < span.end {
        let next = ((at & !0xfff) + 0x1000).min(span.end);
        if !f(at, next) {
            return;
        }
        at = next;
    }
}

/// Writes the pattern over `span`: every word of a page holds that page's pattern word.
/// `rep stosq` rather than a loop because this machine's nested KVM runs guest instructions
/// slowly and a string instruction is one instruction per page.
#[cfg(target_os = "none")]
fn fill(span: Span, seed: u64) {
    per_page(span, |start, end| {
        // SAFETY: [start, end) is RAM from the memory map, outside the guest image (so no
        // Rust object lives there), 8-byte aligned and identity-mapped; assembly rather than
        // Rust pointers because address 0 is RAM too.
        unsafe {
            core::arch::asm!(
                "rep stosq",
                inout("rdi") start => _,
                inout("rcx") (end - start) / 8 => _,
                in("rax") pattern(start & !0xfff, seed),
                options(nostack)
            );
        }
        true
    });
}

/// Reads `span` back; returns the first word that differs and what it holds.
#[cfg(target_os = "none")]
fn verify(span: Span, seed: u64) -> Option<(u64, u64)> {
    let mut bad = None;
    per_page(span, |start, end| {
        let expected = pattern(start & !0xfff, seed);
        let next: u64;
        // SAFETY: as for `fill`; `repe scasq` only reads.
        unsafe {
            core::arch::asm!(
                "repe scasq",
                inout("rdi") start => next,
                inout("rcx") (end - start) / 8 => _,
                in("rax") expected,
                options(nostack, readonly)
            );
        }
        // scasq stops one word past a mismatch; a match of the last word leaves ZF set.
        let last = next - 8;
        let found: u64;
        // SAFETY: `last` is inside [start, end), which `fill` wrote and is mapped RAM.
        unsafe {
            core::arch::asm!("mov {f}, qword ptr [{a}]", a = in(reg) last, f = out(reg) found,
                options(nostack, readonly));
        }
        if found != expected {
            bad = Some((last, found));
            return false;
        }
        true
    });
    bad
}

#[cfg(not(target_os = "none"))]
fn fill(_span: Span, _seed: u64) {}

#[cfg(not(target_os = "none"))]
fn verify(_span: Span, _seed: u64) -> Option<(u64, u64)> {
    None
}

/// Runs the `memory` test over all RAM outside `image`.
pub fn run(bi: &BootInfo, image: Span) -> Result<Detail, Detail> {
    let top = bi.ram_top();
    if crate::paging::map_up_to(top).is_none() {
        return Err(Detail::fmt(format_args!(
            "RAM reaches {top:#x}, above the {:#x} the guest maps; give it less memory",
            crate::paging::MAP_LIMIT
        )));
    }
    let (spans, n, unaligned) = spans(bi.regions(), image);
    let seed = crate::io::rdtsc() | 1;
    let mut bytes = 0u64;
    for span in &spans[..n] {
        fill(*span, seed);
        bytes += span.end - span.start;
    }
    for span in &spans[..n] {
        if let Some((addr, found)) = verify(*span, seed) {
            return Err(Detail::fmt(format_args!(
                "Word at {addr:#x} reads {found:#018x}, wrote {:#018x}",
                pattern(addr, seed)
            )));
        }
    }
    let mut d = Detail::new();
    let _ = write!(
        d,
        "bytes={bytes} regions={n} ram={} top={top:#x} skipped_unaligned={unaligned} image={:#x}-{:#x}",
        bi.ram_bytes(),
        image.start,
        image.end
    );
    Ok(d)
}

/// Stride of the sparse test: one word per 2 MiB (one guest large page).
const SPARSE_STRIDE: u64 = 2 << 20;

/// The sparse probe addresses of `span`: its first word and then every 2 MiB boundary.
pub fn sparse_probes(span: Span) -> impl Iterator<Item = u64> {
    let first_boundary = (span.start + SPARSE_STRIDE - 1) & !(SPARSE_STRIDE - 1);
    core::iter::once(span.start)
        .chain((first_boundary..span.end).step_by(SPARSE_STRIDE as usize))
        .filter(move |a| *a + 8 <= span.end)
        .scan(u64::MAX, |last, a| {
            let dup = *last == a;
            *last = a;
            Some((a, dup))
        })
        .filter_map(|(a, dup)| (!dup).then_some(a))
}

/// Runs the `memory-sparse` test: one pattern word per 2 MiB of every RAM entry, so large
/// guests (above 4 GiB, around the 32-bit hole) are checked in seconds.
pub fn run_sparse(bi: &BootInfo, image: Span) -> Result<Detail, Detail> {
    let top = bi.ram_top();
    if crate::paging::map_up_to(top).is_none() {
        return Err(Detail::fmt(format_args!(
            "RAM reaches {top:#x}, above the {:#x} the guest maps; give it less memory",
            crate::paging::MAP_LIMIT
        )));
    }
    let (spans, n, _) = spans(bi.regions(), image);
    let seed = crate::io::rdtsc() | 1;
    let mut words = 0u64;
    let mut above_4g = 0u64;
    for span in &spans[..n] {
        for a in sparse_probes(*span) {
            fill(
                Span {
                    start: a,
                    end: a + 8,
                },
                seed,
            );
            words += 1;
            if a >= 1 << 32 {
                above_4g += 1;
            }
        }
    }
    for span in &spans[..n] {
        for a in sparse_probes(*span) {
            if let Some((addr, found)) = verify(
                Span {
                    start: a,
                    end: a + 8,
                },
                seed,
            ) {
                return Err(Detail::fmt(format_args!(
                    "Word at {addr:#x} reads {found:#018x}, wrote {:#018x}",
                    pattern(addr & !0xfff, seed)
                )));
            }
        }
    }
    Ok(Detail::fmt(format_args!(
        "words={words} above_4g={above_4g} ram={} top={top:#x} regions={n}",
        bi.ram_bytes()
    )))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ram(start: u64, len: u64) -> MemRegion {
        MemRegion {
            start,
            len,
            kind: MEM_TYPE_RAM,
        }
    }

    #[test]
    fn spans_cut_the_image_out_and_skip_reserved() {
        let regions = [
            ram(0, 0x9fc00),
            MemRegion {
                start: 0xf0000,
                len: 0x10000,
                kind: 2,
            },
            ram(0x100000, 0x7f00000),
        ];
        let (s, n, unaligned) = spans(
            &regions,
            Span {
                start: 0x100000,
                end: 0x180000,
            },
        );
        assert_eq!(
            &s[..n],
            &[
                Span {
                    start: 0,
                    end: 0x9fc00
                },
                Span {
                    start: 0x180000,
                    end: 0x8000000
                }
            ]
        );
        assert_eq!(unaligned, 0);
    }

    #[test]
    fn spans_split_a_region_around_the_image_and_align_inwards() {
        let (s, n, unaligned) = spans(
            &[ram(3, 0x1000)],
            Span {
                start: 0x800,
                end: 0x900,
            },
        );
        assert_eq!(
            &s[..n],
            &[
                Span {
                    start: 8,
                    end: 0x800
                },
                Span {
                    start: 0x900,
                    end: 0x1000
                }
            ]
        );
        assert_eq!(unaligned, 5 + 3);
    }

    #[test]
    fn sparse_probes_take_the_start_and_every_2_mib_boundary() {
        let probes: std::vec::Vec<u64> = sparse_probes(Span {
            start: 0x25b000,
            end: 0x800000,
        })
        .collect();
        assert_eq!(probes, [0x25b000, 0x400000, 0x600000]);
        let aligned: std::vec::Vec<u64> = sparse_probes(Span {
            start: 0x200000,
            end: 0x400000,
        })
        .collect();
        assert_eq!(aligned, [0x200000]);
    }

    #[test]
    fn pattern_differs_between_neighbours() {
        assert_ne!(pattern(0x1000, 1), pattern(0x1008, 1));
        assert_ne!(pattern(0x1000, 1), pattern(0x1000, 3));
    }
}
