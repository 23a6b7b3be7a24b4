//! The occupancy of one MIG-capable GPU and the rules a new GPU instance must satisfy: an
//! allowed start slot, no overlap with existing instances, and the profile's maximum count.
//! The planner, the simulated backend and the reservation checks all use this one type, so
//! they enforce the same rules as the hardware.

use serde::Serialize;
use thiserror::Error;

use super::{GpuModel, MigProfile};

/// Why an instance cannot be placed.
#[derive(Debug, Error, Clone, PartialEq, Eq)]
pub enum PlacementError {
    /// The start slot is not one the profile allows.
    #[error("Profile {profile} cannot start at slot {start}: allowed starts are {allowed:?}")]
    BadStart {
        /// Profile name.
        profile: String,
        /// Start asked for.
        start: u32,
        /// Allowed starts.
        allowed: Vec<u32>,
    },
    /// The slots overlap an existing instance (NVML: INSUFFICIENT_RESOURCES).
    #[error("Insufficient resources: slots {start}..{end} overlap an existing GPU instance")]
    Overlap {
        /// First slot asked for.
        start: u32,
        /// One past the last slot.
        end: u32,
    },
    /// The profile already has its maximum number of instances.
    #[error(
        "Insufficient resources: profile {profile} already has its maximum of {max} instances"
    )]
    MaxCount {
        /// Profile name.
        profile: String,
        /// The maximum.
        max: u32,
    },
    /// The GPU is handed out whole, so no MIG instance can be made on it.
    #[error("Insufficient resources: the GPU is assigned whole")]
    WholeGpu,
}

/// One GPU instance on a layout.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize)]
pub struct Placed {
    /// Profile id.
    pub profile_id: u32,
    /// Start slot.
    pub start: u32,
}

/// Occupancy of one GPU.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Layout {
    /// Bit `i` set when placement unit `i` is taken.
    pub used: u32,
    /// Whether the GPU is assigned whole (no MIG instances possible).
    pub whole: bool,
    /// Instances, kept sorted.
    pub instances: Vec<Placed>,
}

impl Layout {
    /// An empty GPU.
    pub fn empty() -> Self {
        Layout {
            used: 0,
            whole: false,
            instances: Vec::new(),
        }
    }

    /// Checks that `profile` may be placed at `start`.
    pub fn check(&self, profile: &MigProfile, start: u32) -> Result<(), PlacementError> {
        if self.whole {
            return Err(PlacementError::WholeGpu);
        }
        if !profile.starts.contains(&start) {
            return Err(PlacementError::BadStart {
                profile: profile.name.to_string(),
                start,
                allowed: profile.starts.to_vec(),
            });
        }
        if self.used & profile.mask_at(start) != 0 {
            return Err(PlacementError::Overlap {
                start,
                end: start + profile.size,
            });
        }
        let count = self
            .instances
            .iter()
            .filter(|p| p.profile_id == profile.id)
            .count();
        if count as u32 >= profile.max_count {
            return Err(PlacementError::MaxCount {
                profile: profile.name.to_string(),
                max: profile.max_count,
            });
        }
        Ok(())
    }

    /// Places `profile` at `start` after [`Layout::check`].
    pub fn place(&mut self, profile: &MigProfile, start: u32) -> Result<(), PlacementError> {
        self.check(profile, start)?;
        self.used |= profile.mask_at(start);
        let placed = Placed {
            profile_id: profile.id,
            start,
        };
        let at = self.instances.binary_search(&placed).unwrap_or_else(|i| i);
        self.instances.insert(at, placed);
        Ok(())
    }

    /// Removes the instance of `profile` at `start`; false when there is none.
    pub fn remove(&mut self, profile: &MigProfile, start: u32) -> bool {
        let placed = Placed {
            profile_id: profile.id,
            start,
        };
        match self.instances.binary_search(&placed) {
            Ok(i) => {
                self.instances.remove(i);
                self.used &= !profile.mask_at(start);
                true
            }
            Err(_) => false,
        }
    }

    /// Whether the GPU can be assigned whole (no instances, not already whole).
    pub fn can_take_whole(&self) -> bool {
        !self.whole && self.instances.is_empty()
    }

    /// The starts at which `profile` can be placed now, in ascending order.
    pub fn free_starts(&self, profile: &MigProfile) -> Vec<u32> {
        profile
            .starts
            .iter()
            .copied()
            .filter(|s| self.check(profile, *s).is_ok())
            .collect()
    }

    /// The profile with the most memory that can still be placed, with its first free start.
    pub fn largest_free<'m>(&self, model: &'m GpuModel) -> Option<(&'m MigProfile, u32)> {
        model
            .profiles
            .iter()
            .filter_map(|p| self.free_starts(p).first().map(|s| (p, *s)))
            .max_by_key(|(p, _)| (p.memory_mib, p.compute_slices))
    }

    /// Free placement units.
    pub fn free_units(&self, model: &GpuModel) -> u32 {
        if self.whole {
            0
        } else {
            model.placement_units - self.used.count_ones()
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::mig::model_by_key;

    #[test]
    fn overlap_is_insufficient_resources() {
        let m = model_by_key("h100-80gb").unwrap();
        let mut l = Layout::empty();
        l.place(m.profile("3g.40gb").unwrap(), 4).unwrap();
        let err = l.place(m.profile("2g.20gb").unwrap(), 4).unwrap_err();
        assert_eq!(err, PlacementError::Overlap { start: 4, end: 6 });
        assert!(err.to_string().starts_with("Insufficient resources"));
        l.place(m.profile("4g.40gb").unwrap(), 0).unwrap();
        assert_eq!(l.free_units(m), 0);
    }

    #[test]
    fn start_slot_rules_and_max_count_are_enforced() {
        let m = model_by_key("a100-40gb").unwrap();
        let mut l = Layout::empty();
        let two = m.profile("2g.10gb").unwrap();
        assert!(matches!(
            l.check(two, 1),
            Err(PlacementError::BadStart { .. })
        ));
        assert!(matches!(
            l.check(two, 6),
            Err(PlacementError::BadStart { .. })
        ));
        let me = m.profile("1g.5gb+me").unwrap();
        l.place(me, 0).unwrap();
        assert!(matches!(
            l.place(me, 1),
            Err(PlacementError::MaxCount { .. })
        ));
        // Slot 7 is never a 1g start: seven 1g instances at most.
        let one = m.profile("1g.5gb").unwrap();
        for s in 1..7 {
            l.place(one, s).unwrap();
        }
        assert!(l.free_starts(one).is_empty());
    }

    #[test]
    fn remove_frees_the_slots_and_whole_blocks_everything() {
        let m = model_by_key("h200").unwrap();
        let mut l = Layout::empty();
        let p = m.profile("7g.141gb").unwrap();
        l.place(p, 0).unwrap();
        assert!(!l.can_take_whole());
        assert!(l.remove(p, 0));
        assert!(!l.remove(p, 0));
        assert!(l.can_take_whole());
        l.whole = true;
        assert_eq!(l.check(p, 0), Err(PlacementError::WholeGpu));
        assert!(l.largest_free(m).is_none());
    }

    #[test]
    fn largest_free_follows_fragmentation() {
        let m = model_by_key("h100-80gb").unwrap();
        let mut l = Layout::empty();
        l.place(m.profile("1g.10gb").unwrap(), 0).unwrap();
        l.place(m.profile("1g.10gb").unwrap(), 5).unwrap();
        // Slots 0 and 5 taken: no 3g/4g/7g; a 2g fits at 2.
        let (p, s) = l.largest_free(m).unwrap();
        assert_eq!((p.name, s), ("2g.20gb", 2));
    }
}
