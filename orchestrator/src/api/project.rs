//! What callers see: the service's answers (its store rows and facts) copied into the
//! API's wire types ([`super::types`]), field by field, so neither side's shape leaks into
//! the other. The projection is the API's: the tenant layer answers in its own values.

use super::types::{
    CreateResponse, EventView, GpuSlice, LogChunk, QuarantinedSliceView, StepView, TenantList,
    TenantView,
};
use crate::store::{EventRecord, GpuPlacement, QuarantinedSlice, StepRecord};
use crate::tenant::logs::LogRead;
use crate::tenant::view::{Created, TenantStatus};

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

/// A tenant's status, as the API shows it.
pub fn tenant(s: TenantStatus) -> TenantView {
    let t = s.record;
    TenantView {
        name: t.name.to_string(),
        state: t.state,
        op: t.op,
        error: t.error,
        steps: s.steps.into_iter().map(step).collect(),
        spec: t.spec,
        uid: s.uid,
        pid: s.pid,
        gpu: s.gpu.map(gpu_slice),
        created_ms: t.created_ms,
        updated_ms: t.updated_ms,
        recovering: s.recovering,
        agent_channel: s.agent_channel,
        vsock_cid: s.vsock_cid,
        guest: t.guest,
    }
}

/// The tenants a caller may see, as the API shows them.
pub fn tenants(list: Vec<TenantStatus>) -> TenantList {
    TenantList {
        tenants: list.into_iter().map(tenant).collect(),
    }
}

/// A new tenant and its token, as the API shows them.
pub fn created(c: Created) -> CreateResponse {
    CreateResponse {
        tenant: tenant(c.tenant),
        token: c.token,
    }
}

/// A piece of a log, as the API shows it.
pub fn log(l: LogRead) -> LogChunk {
    LogChunk {
        stream: l.stream,
        text: l.text,
        next: l.next,
        skipped: l.skipped,
        events: l.events.into_iter().map(event).collect(),
    }
}
