//! Per-tenant metrics in the Prometheus (OpenMetrics) text format, with prometheus-client.
//!
//! Series, each labelled with the tenant's name (and only fixed words besides: a route
//! label, a status code, a refusal reason; never a prompt, a model name or a path as sent):
//!
//! | series | kind |
//! |---|---|
//! | `tenantvm_frontdoor_requests_total{tenant,route,status}` | counter |
//! | `tenantvm_frontdoor_refusals_total{tenant,reason}` (`rate`, `concurrency`, `size`) | counter |
//! | `tenantvm_frontdoor_tokens_total{tenant,kind}` (`prompt`, `completion`: the payload's usage counts) | counter |
//! | `tenantvm_frontdoor_in_flight{tenant}` | gauge |
//! | `tenantvm_frontdoor_first_byte_seconds{tenant}` (time to the first piece of the answer: the first token of a stream) | histogram |
//! | `tenantvm_frontdoor_request_seconds{tenant}` (to the answer's end) | histogram |
//! | `tenantvm_vm_cpu_seconds{tenant}`, `tenantvm_vm_memory_bytes{tenant}` (the VM's cgroup, read at scrape) | gauge |
//! | `tenantvm_vm_disk_bytes{tenant,op}` (`read`, `write`), `tenantvm_vm_disk_operations{tenant,op}` (`read`, `write`, `flush`): the VMM's own counters, all disks, since the VMM started, read at scrape | gauge |
//! | `tenantvm_gpu_memory_used_bytes{tenant,source}`, `tenantvm_gpu_memory_bytes{tenant,source}`, `tenantvm_gpu_utilization_percent{tenant,source}` (the tenant's GPU slice; `source` is `nvml` or `simulated`) | gauge |
//!
//! A figure that cannot be read (a VMM that does not answer or reports no disk, a GPU
//! backend that does not measure, NVML's utilisation of a MIG instance) is absent, never
//! zero.
//!
//! Who sees what: [`Metrics::render`] with `Some(tenant)` keeps only that tenant's samples
//! (what its key or token gets: `GET /metrics` at the front door, `GET /v1/metrics` on the
//! API), with `None` everything (the admin).

pub mod sample;

use std::path::Path;
use std::sync::atomic::AtomicU64;
use std::time::Duration;

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{exponential_buckets, Histogram};
use prometheus_client::registry::Registry;

use tenantvm_gpu::backend::{SliceUsage, UsageSource};

use crate::backend::DiskCounters;
use crate::jail::CgroupHandle;

/// The content type of [`Metrics::render`]'s text.
pub const CONTENT_TYPE: &str = "application/openmetrics-text; version=1.0.0; charset=utf-8";

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct TenantLabel {
    tenant: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct RequestLabels {
    tenant: String,
    route: String,
    status: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ReasonLabels {
    tenant: String,
    reason: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct KindLabels {
    tenant: String,
    kind: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct OpLabels {
    tenant: String,
    op: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct SourceLabels {
    tenant: String,
    source: String,
}

/// Every `op` label the disk series use.
const DISK_OPS: [&str; 3] = ["read", "write", "flush"];
/// Every `source` label the GPU series use.
const GPU_SOURCES: [UsageSource; 2] = [UsageSource::Nvml, UsageSource::Simulated];

type Histograms = Family<TenantLabel, Histogram, fn() -> Histogram>;

fn latency_histogram() -> Histogram {
    // 1 ms to about 65 s.
    Histogram::new(exponential_buckets(0.001, 2.0, 17))
}

/// Why the front door refused a request (a fixed word for the label).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RefusalReason {
    /// Over `quotas.requests_per_s`.
    Rate,
    /// Over `quotas.max_concurrency`.
    Concurrency,
    /// Over `quotas.max_request_bytes`.
    Size,
}

impl RefusalReason {
    fn label(self) -> &'static str {
        match self {
            RefusalReason::Rate => "rate",
            RefusalReason::Concurrency => "concurrency",
            RefusalReason::Size => "size",
        }
    }
}

/// The label sets recorded for one tenant name, so that they can be dropped.
#[derive(Default)]
struct Tracked {
    requests: std::collections::HashSet<RequestLabels>,
    refusals: std::collections::HashSet<ReasonLabels>,
    tokens: std::collections::HashSet<KindLabels>,
}

/// Which tenant (row id) each name's series belong to, and what was recorded for it.
#[derive(Default)]
struct Owners {
    ids: std::collections::HashMap<String, i64>,
    tracked: std::collections::HashMap<String, Tracked>,
}

/// The daemon's metrics.
pub struct Metrics {
    owners: std::sync::Mutex<Owners>,
    registry: Registry,
    requests: Family<RequestLabels, Counter>,
    refusals: Family<ReasonLabels, Counter>,
    tokens: Family<KindLabels, Counter>,
    in_flight: Family<TenantLabel, Gauge>,
    first_byte: Histograms,
    total: Histograms,
    cpu: Family<TenantLabel, Gauge<f64, AtomicU64>>,
    memory: Family<TenantLabel, Gauge>,
    disk_bytes: Family<OpLabels, Gauge>,
    disk_ops: Family<OpLabels, Gauge>,
    gpu_used: Family<SourceLabels, Gauge>,
    gpu_total: Family<SourceLabels, Gauge>,
    gpu_busy: Family<SourceLabels, Gauge>,
}

impl std::fmt::Debug for Metrics {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Metrics").finish_non_exhaustive()
    }
}

impl Default for Metrics {
    fn default() -> Self {
        let mut registry = Registry::default();
        let requests = Family::<RequestLabels, Counter>::default();
        let refusals = Family::<ReasonLabels, Counter>::default();
        let tokens = Family::<KindLabels, Counter>::default();
        let in_flight = Family::<TenantLabel, Gauge>::default();
        let first_byte: Histograms = Family::new_with_constructor(latency_histogram);
        let total: Histograms = Family::new_with_constructor(latency_histogram);
        let cpu = Family::<TenantLabel, Gauge<f64, AtomicU64>>::default();
        let memory = Family::<TenantLabel, Gauge>::default();
        let disk_bytes = Family::<OpLabels, Gauge>::default();
        let disk_ops = Family::<OpLabels, Gauge>::default();
        let gpu_used = Family::<SourceLabels, Gauge>::default();
        let gpu_total = Family::<SourceLabels, Gauge>::default();
        let gpu_busy = Family::<SourceLabels, Gauge>::default();
        registry.register(
            "tenantvm_frontdoor_requests",
            "Front door requests by route and status",
            requests.clone(),
        );
        registry.register(
            "tenantvm_frontdoor_refusals",
            "Front door requests refused by a quota",
            refusals.clone(),
        );
        registry.register(
            "tenantvm_frontdoor_tokens",
            "Tokens by kind, from the payload's usage counts",
            tokens.clone(),
        );
        registry.register(
            "tenantvm_frontdoor_in_flight",
            "Front door requests in flight",
            in_flight.clone(),
        );
        registry.register(
            "tenantvm_frontdoor_first_byte_seconds",
            "Time to the first piece of the answer (the first token of a stream)",
            first_byte.clone(),
        );
        registry.register(
            "tenantvm_frontdoor_request_seconds",
            "Time to the end of the answer",
            total.clone(),
        );
        registry.register(
            "tenantvm_vm_cpu_seconds",
            "CPU time of the tenant's VM (its cgroup)",
            cpu.clone(),
        );
        registry.register(
            "tenantvm_vm_memory_bytes",
            "Memory of the tenant's VM (its cgroup)",
            memory.clone(),
        );
        registry.register(
            "tenantvm_vm_disk_bytes",
            "Bytes the VM's disks read and wrote since its VMM started (the VMM's counters)",
            disk_bytes.clone(),
        );
        registry.register(
            "tenantvm_vm_disk_operations",
            "Requests the VM's disks completed since its VMM started (the VMM's counters)",
            disk_ops.clone(),
        );
        registry.register(
            "tenantvm_gpu_memory_used_bytes",
            "GPU memory in use in the tenant's slice (source: nvml, or simulated)",
            gpu_used.clone(),
        );
        registry.register(
            "tenantvm_gpu_memory_bytes",
            "GPU memory of the tenant's slice (source: nvml, or simulated)",
            gpu_total.clone(),
        );
        registry.register(
            "tenantvm_gpu_utilization_percent",
            "Share of time the slice's engines were busy (source: nvml, or simulated)",
            gpu_busy.clone(),
        );
        Metrics {
            owners: Default::default(),
            registry,
            requests,
            refusals,
            tokens,
            in_flight,
            first_byte,
            total,
            cpu,
            memory,
            disk_bytes,
            disk_ops,
            gpu_used,
            gpu_total,
            gpu_busy,
        }
    }
}

fn op(name: &str, op: &str) -> OpLabels {
    OpLabels {
        tenant: name.to_string(),
        op: op.to_string(),
    }
}

fn source(name: &str, source: UsageSource) -> SourceLabels {
    SourceLabels {
        tenant: name.to_string(),
        source: source.label().to_string(),
    }
}

fn gauge_value(v: u64) -> i64 {
    i64::try_from(v).unwrap_or(i64::MAX)
}

fn tenant(name: &str) -> TenantLabel {
    TenantLabel {
        tenant: name.to_string(),
    }
}

/// A request in flight: counted until dropped.
#[derive(Debug)]
pub struct InFlight {
    gauge: Gauge,
}

impl Drop for InFlight {
    fn drop(&mut self) {
        self.gauge.dec();
    }
}

impl Metrics {
    fn owners(&self) -> std::sync::MutexGuard<'_, Owners> {
        self.owners
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// Says that the series named `tenant_name` are those of tenant row `id` from now on:
    /// when the name belonged to another (destroyed) tenant, its series are dropped first,
    /// so a new tenant under a reused name never reads its predecessor's figures.
    pub fn claim(&self, tenant_name: &str, id: i64) {
        let mut owners = self.owners();
        let previous = owners.ids.insert(tenant_name.to_string(), id);
        if previous.is_some_and(|p| p != id) {
            if let Some(t) = owners.tracked.remove(tenant_name) {
                for l in &t.requests {
                    self.requests.remove(l);
                }
                for l in &t.refusals {
                    self.refusals.remove(l);
                }
                for l in &t.tokens {
                    self.tokens.remove(l);
                }
            }
            let label = tenant(tenant_name);
            self.in_flight.remove(&label);
            self.first_byte.remove(&label);
            self.total.remove(&label);
            self.cpu.remove(&label);
            self.memory.remove(&label);
            self.forget_disk(tenant_name);
            self.forget_gpu(tenant_name);
        }
    }

    fn forget_disk(&self, tenant_name: &str) {
        for o in DISK_OPS {
            self.disk_bytes.remove(&op(tenant_name, o));
            self.disk_ops.remove(&op(tenant_name, o));
        }
    }

    fn forget_gpu(&self, tenant_name: &str) {
        for s in GPU_SOURCES {
            let l = source(tenant_name, s);
            self.gpu_used.remove(&l);
            self.gpu_total.remove(&l);
            self.gpu_busy.remove(&l);
        }
    }

    /// Sets the disk series from the VMM's counters; `None` (no VM, no disk, a VMM that did
    /// not answer) removes them, so no stale figure is shown.
    pub fn sample_disk(&self, tenant_name: &str, counters: Option<DiskCounters>) {
        let Some(c) = counters else {
            self.forget_disk(tenant_name);
            return;
        };
        for (o, bytes, ops) in [
            ("read", Some(c.read_bytes), c.read_ops),
            ("write", Some(c.write_bytes), c.write_ops),
            ("flush", None, c.flush_ops),
        ] {
            let l = op(tenant_name, o);
            if let Some(b) = bytes {
                self.disk_bytes.get_or_create(&l).set(gauge_value(b));
            }
            self.disk_ops.get_or_create(&l).set(gauge_value(ops));
        }
    }

    /// Sets the GPU series from the slice's usage, labelled with where it came from;
    /// `None` (no slice, or a backend that cannot read it) removes them. A utilisation the
    /// backend cannot tell is left out.
    pub fn sample_gpu(&self, tenant_name: &str, usage: Option<SliceUsage>) {
        self.forget_gpu(tenant_name);
        let Some(u) = usage else {
            return;
        };
        let l = source(tenant_name, u.source);
        self.gpu_used
            .get_or_create(&l)
            .set(gauge_value(u.memory_used_bytes));
        self.gpu_total
            .get_or_create(&l)
            .set(gauge_value(u.memory_total_bytes));
        if let Some(p) = u.utilization_percent {
            self.gpu_busy.get_or_create(&l).set(i64::from(p));
        }
    }

    /// Counts a finished request (`route` is a fixed label such as `completions`).
    pub fn request(&self, tenant_name: &str, route: &str, status: u16) {
        let labels = RequestLabels {
            tenant: tenant_name.to_string(),
            route: route.to_string(),
            status: status.to_string(),
        };
        self.requests.get_or_create(&labels).inc();
        let mut owners = self.owners();
        let tracked = owners.tracked.entry(tenant_name.to_string()).or_default();
        tracked.requests.insert(labels);
    }

    /// Counts a refusal.
    pub fn refused(&self, tenant_name: &str, reason: RefusalReason) {
        let labels = ReasonLabels {
            tenant: tenant_name.to_string(),
            reason: reason.label().to_string(),
        };
        self.refusals.get_or_create(&labels).inc();
        let mut owners = self.owners();
        let tracked = owners.tracked.entry(tenant_name.to_string()).or_default();
        tracked.refusals.insert(labels);
    }

    /// Adds the payload's usage counts.
    pub fn tokens(&self, tenant_name: &str, prompt: u64, completion: u64) {
        for (kind, n) in [("prompt", prompt), ("completion", completion)] {
            let labels = KindLabels {
                tenant: tenant_name.to_string(),
                kind: kind.to_string(),
            };
            self.tokens.get_or_create(&labels).inc_by(n);
            let mut owners = self.owners();
            let tracked = owners.tracked.entry(tenant_name.to_string()).or_default();
            tracked.tokens.insert(labels);
        }
    }

    /// One more request in flight until the guard is dropped.
    pub fn in_flight(&self, tenant_name: &str) -> InFlight {
        let gauge = self.in_flight.get_or_create(&tenant(tenant_name)).clone();
        gauge.inc();
        InFlight { gauge }
    }

    /// Records the time to the answer's first piece.
    pub fn first_byte(&self, tenant_name: &str, after: Duration) {
        self.first_byte
            .get_or_create(&tenant(tenant_name))
            .observe(after.as_secs_f64());
    }

    /// Records the time to the answer's end.
    pub fn finished(&self, tenant_name: &str, after: Duration) {
        self.total
            .get_or_create(&tenant(tenant_name))
            .observe(after.as_secs_f64());
    }

    /// Reads the VM's CPU time and memory from its cgroup into the gauges (missing files:
    /// the gauges keep their last value).
    pub fn sample_cgroup(&self, tenant_name: &str, cgroup: &CgroupHandle) {
        let (cpu, memory) = read_cgroup(cgroup);
        if let Some(s) = cpu {
            self.cpu.get_or_create(&tenant(tenant_name)).set(s);
        }
        if let Some(b) = memory {
            self.memory
                .get_or_create(&tenant(tenant_name))
                .set(i64::try_from(b).unwrap_or(i64::MAX));
        }
    }

    /// The text exposition: every series (`None`, the admin) or one tenant's only.
    pub fn render(&self, only: Option<&str>) -> String {
        let mut text = String::new();
        // Writing to a String cannot fail.
        let _ = prometheus_client::encoding::text::encode(&mut text, &self.registry);
        match only {
            None => text,
            Some(name) => {
                let label = format!("tenant=\"{name}\"");
                text.lines()
                    .filter(|l| l.starts_with('#') || l.contains(&label))
                    .flat_map(|l| [l, "\n"])
                    .collect()
            }
        }
    }
}

fn read_number(path: &Path) -> Option<u64> {
    std::fs::read_to_string(path).ok()?.trim().parse().ok()
}

/// (CPU seconds, memory bytes) of a cgroup, v1 or v2.
fn read_cgroup(cgroup: &CgroupHandle) -> (Option<f64>, Option<u64>) {
    match cgroup {
        CgroupHandle::V2 { path } => {
            let cpu = std::fs::read_to_string(path.join("cpu.stat"))
                .ok()
                .and_then(|s| {
                    s.lines()
                        .find_map(|l| l.strip_prefix("usage_usec "))
                        .and_then(|v| v.trim().parse::<u64>().ok())
                })
                .map(|us| us as f64 / 1e6);
            (cpu, read_number(&path.join("memory.current")))
        }
        CgroupHandle::V1 {
            memory,
            cpu,
            cpuacct,
            ..
        } => (
            // Where cpuacct is mounted apart from cpu, the CPU time is only there.
            read_number(&cpuacct.as_ref().unwrap_or(cpu).join("cpuacct.usage"))
                .map(|ns| ns as f64 / 1e9),
            read_number(&memory.join("memory.usage_in_bytes")),
        ),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_tenant_sees_only_its_own_series_and_the_admin_all() {
        let m = Metrics::default();
        m.request("alice", "completions", 200);
        m.request("bob", "completions", 429);
        m.refused("bob", RefusalReason::Rate);
        m.tokens("alice", 3, 5);
        let held = m.in_flight("alice");
        m.first_byte("alice", Duration::from_millis(3));
        m.finished("alice", Duration::from_millis(30));
        let alice = m.render(Some("alice"));
        assert!(alice.contains("tenantvm_frontdoor_requests_total{tenant=\"alice\",route=\"completions\",status=\"200\"} 1"), "{alice}");
        assert!(
            alice.contains(
                "tenantvm_frontdoor_tokens_total{tenant=\"alice\",kind=\"completion\"} 5"
            ),
            "{alice}"
        );
        assert!(
            alice.contains("tenantvm_frontdoor_in_flight{tenant=\"alice\"} 1"),
            "{alice}"
        );
        assert!(
            alice.contains("tenantvm_frontdoor_first_byte_seconds_count{tenant=\"alice\"} 1"),
            "{alice}"
        );
        assert!(!alice.contains("bob"), "{alice}");
        assert!(alice.ends_with("# EOF\n"), "{alice}");
        drop(held);
        assert!(m
            .render(Some("alice"))
            .contains("tenantvm_frontdoor_in_flight{tenant=\"alice\"} 0"));
        let all = m.render(None);
        assert!(
            all.contains("tenant=\"bob\",reason=\"rate\"} 1") && all.contains("alice"),
            "{all}"
        );
        // A name that is a prefix of another does not match it.
        m.request("al", "models", 200);
        assert!(!m.render(Some("al")).contains("alice"));
    }

    #[test]
    fn a_new_tenant_under_a_reused_name_starts_without_its_predecessors_series() {
        let m = Metrics::default();
        m.claim("alice", 1);
        m.request("alice", "completions", 200);
        m.refused("alice", RefusalReason::Size);
        m.tokens("alice", 1, 2);
        m.first_byte("alice", Duration::from_millis(1));
        m.claim("alice", 1);
        assert!(m.render(Some("alice")).contains("status=\"200\"} 1"));
        // Destroyed, and a new tenant (another row) takes the name.
        m.claim("alice", 2);
        let text = m.render(Some("alice"));
        assert!(!text.contains("tenant=\"alice\""), "{text}");
        m.request("alice", "models", 200);
        assert!(m
            .render(Some("alice"))
            .contains("route=\"models\",status=\"200\"} 1"));
    }

    #[test]
    fn cgroup_cpu_and_memory_are_read_for_v1_and_v2() {
        let dir = tempfile::tempdir().unwrap();
        let v2 = dir.path().join("v2");
        std::fs::create_dir_all(&v2).unwrap();
        std::fs::write(v2.join("cpu.stat"), "usage_usec 2500000\nuser_usec 1\n").unwrap();
        std::fs::write(v2.join("memory.current"), "4096\n").unwrap();
        assert_eq!(
            read_cgroup(&CgroupHandle::V2 { path: v2 }),
            (Some(2.5), Some(4096))
        );
        let (mem, cpu) = (dir.path().join("mem"), dir.path().join("cpu"));
        std::fs::create_dir_all(&mem).unwrap();
        std::fs::create_dir_all(&cpu).unwrap();
        std::fs::write(cpu.join("cpuacct.usage"), "1500000000\n").unwrap();
        std::fs::write(mem.join("memory.usage_in_bytes"), "8192\n").unwrap();
        let v1 = CgroupHandle::V1 {
            memory: mem.clone(),
            cpu,
            pids: dir.path().join("pids"),
            blkio: None,
            devices: None,
            cpuacct: None,
        };
        assert_eq!(read_cgroup(&v1), (Some(1.5), Some(8192)));
        // A host with cpuacct mounted apart from cpu: the time is read from cpuacct's.
        let apart = dir.path().join("cpuacct");
        std::fs::create_dir_all(&apart).unwrap();
        std::fs::write(
            apart.join("cpuacct.usage"),
            "2500000000
",
        )
        .unwrap();
        let cpu_alone = dir.path().join("cpu-alone");
        std::fs::create_dir_all(&cpu_alone).unwrap();
        let separate = CgroupHandle::V1 {
            memory: mem.clone(),
            cpu: cpu_alone,
            pids: dir.path().join("pids"),
            blkio: None,
            devices: None,
            cpuacct: Some(apart),
        };
        assert_eq!(read_cgroup(&separate), (Some(2.5), Some(8192)));
        let m = Metrics::default();
        m.sample_cgroup("carol", &v1);
        let text = m.render(Some("carol"));
        assert!(
            text.contains("tenantvm_vm_memory_bytes{tenant=\"carol\"} 8192"),
            "{text}"
        );
        assert!(
            text.contains("tenantvm_vm_cpu_seconds{tenant=\"carol\"} 1.5"),
            "{text}"
        );
    }

    #[test]
    fn disk_and_gpu_series_are_the_tenants_own_and_absent_when_unknown() {
        let m = Metrics::default();
        let disk = DiskCounters {
            read_bytes: 4096,
            write_bytes: 512,
            read_ops: 8,
            write_ops: 1,
            flush_ops: 2,
        };
        m.sample_disk("alice", Some(disk));
        m.sample_gpu(
            "alice",
            Some(SliceUsage {
                memory_used_bytes: 1 << 30,
                memory_total_bytes: 10 << 30,
                utilization_percent: Some(37),
                source: UsageSource::Simulated,
            }),
        );
        m.sample_gpu(
            "bob",
            Some(SliceUsage {
                memory_used_bytes: 5,
                memory_total_bytes: 10,
                utilization_percent: None,
                source: UsageSource::Nvml,
            }),
        );
        let alice = m.render(Some("alice"));
        for line in [
            "tenantvm_vm_disk_bytes{tenant=\"alice\",op=\"read\"} 4096",
            "tenantvm_vm_disk_bytes{tenant=\"alice\",op=\"write\"} 512",
            "tenantvm_vm_disk_operations{tenant=\"alice\",op=\"read\"} 8",
            "tenantvm_vm_disk_operations{tenant=\"alice\",op=\"write\"} 1",
            "tenantvm_vm_disk_operations{tenant=\"alice\",op=\"flush\"} 2",
            "tenantvm_gpu_memory_used_bytes{tenant=\"alice\",source=\"simulated\"} 1073741824",
            "tenantvm_gpu_memory_bytes{tenant=\"alice\",source=\"simulated\"} 10737418240",
            "tenantvm_gpu_utilization_percent{tenant=\"alice\",source=\"simulated\"} 37",
        ] {
            assert!(alice.contains(line), "{line}\n{alice}");
        }
        assert!(
            !alice.contains("bob") && !alice.contains("source=\"nvml\""),
            "{alice}"
        );
        // No flush bytes: a flush moves none.
        assert!(!alice.contains("disk_bytes{tenant=\"alice\",op=\"flush\"}"));
        let bob = m.render(Some("bob"));
        assert!(!bob.contains("alice"), "{bob}");
        assert!(bob.contains("tenantvm_gpu_memory_used_bytes{tenant=\"bob\",source=\"nvml\"} 5"));
        // NVML's MIG instance has no utilisation: absent, not 0.
        assert!(!bob.contains("tenantvm_gpu_utilization_percent{"), "{bob}");
        assert!(!bob.contains("tenantvm_vm_disk_bytes{"), "{bob}");
        // A VMM that stops answering, a slice that goes: the series go, not stale figures.
        m.sample_disk("alice", None);
        m.sample_gpu("alice", None);
        let alice = m.render(Some("alice"));
        assert!(!alice.contains("tenant=\"alice\""), "{alice}");
        // A new tenant under the name starts without them.
        m.sample_disk("bob", Some(disk));
        m.claim("bob", 1);
        m.claim("bob", 2);
        assert!(!m.render(Some("bob")).contains("tenant=\"bob\""));
    }
}
