//! Reads what a tenant's VM and GPU slice report into its series, at scrape: the VM's
//! cgroup (CPU, memory), its VMM's disk counters (control socket or QMP, within
//! [`VMM_TIMEOUT`]: the VMM runs as the tenant, so a silent one costs its own scrape that
//! much and no more), and its GPU slice's memory and utilisation from the GPU backend.
//! What cannot be read is left absent (see [`super::Metrics::sample_disk`]).

use std::time::Duration;

use crate::store::TenantRecord;
use crate::tenant::service::TenantService;

/// How long a scrape waits for a VMM's counters.
pub const VMM_TIMEOUT: Duration = Duration::from_secs(1);

/// Samples every tenant in `records` at once, each on a thread of its own, so a scrape of
/// all tenants waits for the slowest VMM ([`VMM_TIMEOUT`] at most), not for the sum of the
/// silent ones: a tenant whose VMM stops answering cannot slow the admin's view of the
/// others. Blocks: call it off the async runtime.
pub fn sample_tenants(svc: &TenantService, records: &[TenantRecord]) {
    std::thread::scope(|scope| {
        for record in records {
            let spawned = std::thread::Builder::new()
                .name("tenantvm-sample".into())
                .spawn_scoped(scope, move || sample_tenant(svc, record));
            if let Err(e) = spawned {
                // No thread to spare: this tenant is sampled here, in turn.
                tracing::debug!(tenant = %record.name, error = %e, "sampling in turn");
                sample_tenant(svc, record);
            }
        }
    });
}

/// Samples `record`'s VM (if it has one) and GPU slice (if it holds one) into the metrics.
/// Blocks (files, sockets, the store): call it off the async runtime.
pub fn sample_tenant(svc: &TenantService, record: &TenantRecord) {
    let metrics = svc.metrics();
    let name = record.name.as_str();
    metrics.claim(name, record.id);
    let usage = svc.usage(record, VMM_TIMEOUT);
    if let Some(cgroup) = &usage.cgroup {
        metrics.sample_cgroup(name, cgroup);
    }
    metrics.sample_disk(name, usage.disk);
    metrics.sample_gpu(name, usage.gpu);
}
