//! A GPU tenant's device (schema version 5): the VM's UUID, the route's record and the
//! devices its VM gets, one row per tenant, written by the create steps that decide them and
//! removed when the placement is released.

use rusqlite::{params, OptionalExtension};

use super::{Store, StoreError};

/// The stored device of a tenant.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GpuDeviceRow {
    /// The VM's UUID (the same at every start).
    pub vm_uuid: String,
    /// The route's record, JSON.
    pub record: String,
    /// The devices the VM gets, JSON; None until attach-gpu ran.
    pub devices: Option<String>,
}

impl Store {
    /// The tenant's device row, if any.
    pub fn gpu_device(&self, tenant_id: i64) -> Result<Option<GpuDeviceRow>, StoreError> {
        let conn = self.lock();
        Ok(conn
            .query_row(
                "SELECT vm_uuid, record, devices FROM gpu_devices WHERE tenant_id = ?1",
                [tenant_id],
                |r| {
                    Ok(GpuDeviceRow {
                        vm_uuid: r.get(0)?,
                        record: r.get(1)?,
                        devices: r.get(2)?,
                    })
                },
            )
            .optional()?)
    }

    /// Writes (or replaces) the tenant's device row.
    pub fn set_gpu_device(&self, tenant_id: i64, row: &GpuDeviceRow) -> Result<(), StoreError> {
        let conn = self.lock();
        conn.execute(
            "INSERT INTO gpu_devices (tenant_id, vm_uuid, record, devices) VALUES (?1, ?2, ?3, ?4)
             ON CONFLICT (tenant_id) DO UPDATE SET vm_uuid = ?2, record = ?3, devices = ?4",
            params![tenant_id, row.vm_uuid, row.record, row.devices],
        )?;
        Ok(())
    }

    /// Removes the tenant's device row. Idempotent.
    pub fn remove_gpu_device(&self, tenant_id: i64) -> Result<(), StoreError> {
        let conn = self.lock();
        conn.execute("DELETE FROM gpu_devices WHERE tenant_id = ?1", [tenant_id])?;
        Ok(())
    }

    /// Every device row: (tenant id, row), for finding a card's other vGPU tenants.
    pub fn gpu_devices(&self) -> Result<Vec<(i64, GpuDeviceRow)>, StoreError> {
        let conn = self.lock();
        let mut stmt = conn.prepare(
            "SELECT tenant_id, vm_uuid, record, devices FROM gpu_devices ORDER BY tenant_id",
        )?;
        let rows = stmt.query_map([], |r| {
            Ok((
                r.get(0)?,
                GpuDeviceRow {
                    vm_uuid: r.get(1)?,
                    record: r.get(2)?,
                    devices: r.get(3)?,
                },
            ))
        })?;
        Ok(rows.collect::<Result<_, _>>()?)
    }
}
