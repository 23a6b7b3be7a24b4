//! A VM's disk counters, all its disks together, as its VMM reports them: tenantvm-vmm's
//! block devices through its control socket's `metrics`, QEMU's block backends through QMP
//! `query-blockstats`. The reports come from a process the tenant may control: only known
//! counters are read, a missing or malformed one makes the whole answer unreadable (no
//! partial figures), and sums saturate.

use std::collections::BTreeMap;

use serde::Serialize;

/// Bytes and operations of a VM's disks since its VMM started.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize)]
pub struct DiskCounters {
    /// Bytes read by the guest.
    pub read_bytes: u64,
    /// Bytes written by the guest.
    pub write_bytes: u64,
    /// Read requests completed.
    pub read_ops: u64,
    /// Write requests completed.
    pub write_ops: u64,
    /// Flushes completed.
    pub flush_ops: u64,
}

impl DiskCounters {
    fn add(&mut self, other: DiskCounters) {
        self.read_bytes = self.read_bytes.saturating_add(other.read_bytes);
        self.write_bytes = self.write_bytes.saturating_add(other.write_bytes);
        self.read_ops = self.read_ops.saturating_add(other.read_ops);
        self.write_ops = self.write_ops.saturating_add(other.write_ops);
        self.flush_ops = self.flush_ops.saturating_add(other.flush_ops);
    }
}

/// Whether a device name of tenantvm-vmm's `metrics` is a disk itself (`disk0`), not one
/// of its parts (`disk0.transport`, `disk0.msix`).
fn is_disk(name: &str) -> bool {
    name.strip_prefix("disk")
        .is_some_and(|n| !n.is_empty() && n.bytes().all(|b| b.is_ascii_digit()))
}

/// Sums tenantvm-vmm's block counters (`read_bytes`, `write_bytes`, `read_ops`,
/// `write_ops`, `flush_ops` of every `diskN`; docs/devices.md). None without a disk, an
/// error naming the counter a disk lacks.
pub fn from_vmm(
    devices: &BTreeMap<String, BTreeMap<String, u64>>,
) -> Result<Option<DiskCounters>, String> {
    let mut sum = None::<DiskCounters>;
    for (name, counters) in devices.iter().filter(|(n, _)| is_disk(n)) {
        let get = |c: &str| {
            counters
                .get(c)
                .copied()
                .ok_or_else(|| format!("{name} reports no {c}"))
        };
        let disk = DiskCounters {
            read_bytes: get("read_bytes")?,
            write_bytes: get("write_bytes")?,
            read_ops: get("read_ops")?,
            write_ops: get("write_ops")?,
            flush_ops: get("flush_ops")?,
        };
        sum.get_or_insert_with(DiskCounters::default).add(disk);
    }
    Ok(sum)
}

/// Sums QMP `query-blockstats` (`rd_bytes`, `wr_bytes`, `rd_operations`, `wr_operations`,
/// `flush_operations` of each top-level entry: the block backends the guest's devices use;
/// their `parent` layers are the same I/O again and are not added). None without an entry.
pub fn from_qmp(answer: &serde_json::Value) -> Result<Option<DiskCounters>, String> {
    let entries = answer
        .as_array()
        .ok_or("query-blockstats did not answer a list")?;
    let mut sum = None::<DiskCounters>;
    for (i, entry) in entries.iter().enumerate() {
        let stats = entry
            .get("stats")
            .ok_or_else(|| format!("entry {i} has no stats"))?;
        let get = |c: &str| {
            stats
                .get(c)
                .and_then(serde_json::Value::as_u64)
                .ok_or_else(|| format!("entry {i} has no {c}"))
        };
        let disk = DiskCounters {
            read_bytes: get("rd_bytes")?,
            write_bytes: get("wr_bytes")?,
            read_ops: get("rd_operations")?,
            write_ops: get("wr_operations")?,
            flush_ops: get("flush_operations")?,
        };
        sum.get_or_insert_with(DiskCounters::default).add(disk);
    }
    Ok(sum)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn disk(read: u64, write: u64) -> BTreeMap<String, u64> {
        [
            ("read_bytes", read * 512),
            ("write_bytes", write * 512),
            ("read_ops", read),
            ("write_ops", write),
            ("flush_ops", 1),
            ("notifications", 99),
        ]
        .into_iter()
        .map(|(k, v)| (k.to_string(), v))
        .collect()
    }

    #[test]
    fn vmm_disks_are_summed_and_their_parts_and_other_devices_left_out() {
        let mut devices = BTreeMap::new();
        devices.insert("disk0".to_string(), disk(2, 3));
        devices.insert("disk1".to_string(), disk(5, 0));
        // Parts of a disk and other devices carry counters of the same names: not I/O.
        devices.insert("disk0.transport".to_string(), disk(1000, 1000));
        devices.insert("vsock".to_string(), disk(1000, 1000));
        devices.insert("diskette".to_string(), disk(1000, 1000));
        let sum = from_vmm(&devices).unwrap().unwrap();
        assert_eq!(
            sum,
            DiskCounters {
                read_bytes: 7 * 512,
                write_bytes: 3 * 512,
                read_ops: 7,
                write_ops: 3,
                flush_ops: 2,
            }
        );
        // No disk: nothing to report (not zeros).
        devices.retain(|n, _| !is_disk(n));
        assert_eq!(from_vmm(&devices).unwrap(), None);
        // A disk without a counter: refused, by name.
        let mut broken = disk(1, 1);
        broken.remove("write_ops");
        devices.insert("disk3".to_string(), broken);
        assert_eq!(
            from_vmm(&devices).unwrap_err(),
            "disk3 reports no write_ops"
        );
        // Sums saturate.
        let mut huge = BTreeMap::new();
        for name in ["disk0", "disk1"] {
            let mut d = disk(1, 1);
            d.insert("read_bytes".into(), u64::MAX - 1);
            huge.insert(name.to_string(), d);
        }
        assert_eq!(from_vmm(&huge).unwrap().unwrap().read_bytes, u64::MAX);
    }

    #[test]
    fn qmp_blockstats_top_level_entries_are_summed() {
        let answer = serde_json::json!([
            {"device": "", "qdev": "/machine/peripheral-anon/device[0]/virtio-backend",
             "node-name": "disk0",
             "stats": {"rd_bytes": 4096, "wr_bytes": 1024, "rd_operations": 8,
                       "wr_operations": 2, "flush_operations": 1, "idle_time_ns": 5},
             "parent": {"stats": {"rd_bytes": 4096, "wr_bytes": 1024, "rd_operations": 8,
                                  "wr_operations": 2, "flush_operations": 1}}},
            {"device": "", "node-name": "disk1",
             "stats": {"rd_bytes": 1, "wr_bytes": 2, "rd_operations": 3,
                       "wr_operations": 4, "flush_operations": 5}}
        ]);
        assert_eq!(
            from_qmp(&answer).unwrap(),
            Some(DiskCounters {
                read_bytes: 4097,
                write_bytes: 1026,
                read_ops: 11,
                write_ops: 6,
                flush_ops: 6,
            })
        );
        assert_eq!(from_qmp(&serde_json::json!([])).unwrap(), None);
        from_qmp(&serde_json::json!({"stats": {}})).unwrap_err();
        let err = from_qmp(&serde_json::json!([{"stats": {"rd_bytes": -1}}])).unwrap_err();
        assert_eq!(err, "entry 0 has no rd_bytes");
    }
}
