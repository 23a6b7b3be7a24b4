//! What callers see: the store's rows copied into the API's wire types
//! ([`crate::api::types`]), field by field, so neither side's shape leaks into the other.

use crate::api::types::{EventView, GpuSlice, QuarantinedSliceView, StepView};
use crate::store::{EventRecord, GpuPlacement, QuarantinedSlice, StepRecord};

/// A recorded step, as the API shows it.
pub fn step(s: StepRecord) -> StepView {
    StepView {
        step: s.step,
        status: s.status,
        error: s.error,
        started_ms: s.started_ms,
        finished_ms: s.finished_ms,
    }
}

/// A GPU placement, as the API shows it.
pub fn gpu_slice(p: GpuPlacement) -> GpuSlice {
    GpuSlice {
        gpu: p.gpu,
        slots: p.slots,
        label: p.label,
    }
}

/// A lifecycle event, as the API shows it.
pub fn event(e: EventRecord) -> EventView {
    EventView {
        id: e.id,
        at_ms: e.at_ms,
        kind: e.kind,
        message: e.message,
    }
}

/// A quarantined slice, as the API shows it.
pub fn quarantined(q: QuarantinedSlice) -> QuarantinedSliceView {
    QuarantinedSliceView {
        gpu: q.gpu,
        slots: q.slots,
        label: q.label,
        reason: q.reason,
        since_ms: q.since_ms,
    }
}
