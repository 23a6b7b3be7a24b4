//! The fake host's switches: what is broken on it, one per check's failure.

/// What is broken on the fake host.
#[derive(Debug, Clone, Copy, Default)]
pub struct Broken {
    /// Tenants run without a memory limit in their cgroup.
    pub no_memory_limit: bool,
    /// The memory limit is written but not enforced (the controller is not really there).
    pub memory_not_enforced: bool,
    /// The CPU quota is written but not enforced.
    pub cpu_not_enforced: bool,
    /// Tenants run without a CPU quota, and a busy neighbour slows the others down.
    pub no_cpu_quota: bool,
    /// Disks are plaintext: what a payload writes is readable on the host.
    pub plaintext_disk: bool,
    /// The crypto-shred step of departures is disabled (the test-only hook).
    pub shred_disabled: bool,
    /// All tenants are routed to one payload with one shared prefix cache.
    pub shared_payload: bool,
    /// A debug mode logs every prompt to the daemon's log.
    pub logs_prompts: bool,
    /// A tenant's token reads every tenant's logs and receipts.
    pub cross_reads: bool,
    /// Metrics are served unscoped: a tenant's token or key reads every tenant's series.
    pub metrics_unscoped: bool,
    /// Metrics answer with no series at all, not even the reader's own: scoping cannot be
    /// judged from them.
    pub metrics_empty: bool,
    /// The plaintext scan is blind (reads nothing): what check 9's positive control is for.
    pub blind_scan: bool,
    /// A guest gets more memory than it was given (an in-guest overrun takes all it asks
    /// for), and the host's memory pressure slows its neighbours.
    pub guest_ram_unbounded: bool,
    /// The guest agents refuse test loads (an old guest image).
    pub guest_loads_refused: bool,
    /// Every tenant's disk opens with every tenant's key (one key for all).
    pub shared_disk_key: bool,
    /// No disk opens even with its own key (what check 9's key control is for).
    pub keys_open_nothing: bool,
    /// A guest touching more than its RAM gets its VMM killed by its own cgroup (the VMM
    /// overhead allowance is too small): the tenant fails, its neighbours do not notice.
    pub vmm_killed_by_overrun: bool,
    /// Receipts say nothing of the pushed models the shredded disk held.
    pub receipt_silent_on_models: bool,
    /// The GPU backend keeps a departed tenant's MIG instance (destroy-gpu-instance
    /// skipped).
    pub gpu_instance_left: bool,
    /// A departed tenant's VF keeps its vGPU type (`current_vgpu_type` not cleared).
    pub vf_type_left: bool,
    /// A departed tenant's device stays bound to vfio-pci (no rebind to its host driver).
    pub vfio_left_bound: bool,
    /// The store keeps a departed tenant's GPU reservation.
    pub reservation_left: bool,
    /// The receipt's GPU scrub step is recorded as skipped although a slice was held.
    pub gpu_scrub_skipped: bool,
    /// The scrub does not verify: the slice is quarantined (the receipt says so, the daemon
    /// lists it, its device stays bound): an honest outcome.
    pub gpu_quarantined: bool,
    /// The slice is quarantined but the receipt does not say so.
    pub quarantine_unrecorded: bool,
    /// The host's GPU view shows nothing, not even a running tenant's slice (what check
    /// 10's GPU control is for).
    pub gpu_view_blind: bool,
    /// A guest allocates GPU memory past its slice (the slice does not bound it).
    pub gpu_memory_unbounded: bool,
    /// An MPS control daemon runs on the host.
    pub gpu_mps: bool,
    /// A tenant GPU's VF carries a time-sliced vGPU type.
    pub gpu_time_sliced: bool,
    /// The CPU quota's control (busy processes outside any cgroup) cannot run.
    pub cpu_control_fails: bool,
    /// The probe image has no CUDA driver.
    pub no_cuda_in_guest: bool,
    /// No GPU slice is free: GPU requests are refused (409).
    pub gpu_full: bool,
    /// Slices share the GPU's compute (time-slicing, MPS): a slice's compute load runs at
    /// a quarter of its rate while another tenant's compute load runs.
    pub gpu_compute_shared: bool,
}
