//! The checks of `tenantvm verify`, one file per family, each a [`Check`]
//! that sees the host only through [`VerifyHost`](super::host::VerifyHost) and makes its
//! probe tenants through [`Probes`](super::probe::Probes): [`threat`] (1), [`gpu`] (2, 3),
//! [`memory`] (4; its GPU half [`gpu_memory`]), [`prefix`] (5), [`batching`] (6),
//! [`visibility`] (7), [`noisy`] (8; its GPU half [`noisy_gpu`]), [`at_rest`] (9),
//! [`departure`] (10; what a departed GPU slice leaves: [`gpu_departure`]). The host
//! support they run on (the live host, probes, statistics, the report) is the rest of
//! [`crate::verify`].

pub mod at_rest;
pub mod batching;
pub mod departure;
pub mod gpu;
pub mod gpu_departure;
pub mod gpu_memory;
pub mod memory;
pub mod noisy;
pub mod noisy_gpu;
pub mod prefix;
pub mod threat;
pub mod visibility;

use crate::verify::{Check, CheckId};

/// The check that implements `id`.
pub fn check_for(id: CheckId) -> Box<dyn Check> {
    match id {
        CheckId::ThreatModel => Box::new(threat::ThreatModelCheck),
        CheckId::MigSku => Box::new(gpu::MigSkuCheck),
        CheckId::PartitionArithmetic => Box::new(gpu::PartitionCheck),
        CheckId::MemoryPartition => Box::new(memory::MemoryPartitionCheck),
        CheckId::PrefixCache => Box::new(prefix::PrefixCacheCheck),
        CheckId::Batching => Box::new(batching::BatchingCheck),
        CheckId::Visibility => Box::new(visibility::VisibilityCheck),
        CheckId::NoisyNeighbour => Box::new(noisy::NoisyNeighbourCheck),
        CheckId::WeightsAtRest => Box::new(at_rest::WeightsAtRestCheck),
        CheckId::Departure => Box::new(departure::DepartureCheck),
    }
}
