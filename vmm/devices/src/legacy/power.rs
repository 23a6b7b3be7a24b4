//! Ways for the guest to end the VM: the ACPI sleep control register (power-off and reset)
//! and the pvpanic crash port.

use std::sync::Arc;

use super::{GuestRequest, GuestRequestSink};
use crate::bus::BusDevice;

/// SLP_EN bit of the ACPI hardware-reduced sleep control register.
const SLP_EN_BIT: u8 = 1 << 5;
/// SLP_TYP field shift in the sleep control register.
const SLP_TYP_SHIFT: u8 = 2;
/// SLP_TYP field mask (3 bits).
const SLP_TYP_MASK: u8 = 0b111;
/// SLP_TYP value for S5 (soft off), as the DSDT's `_S5` package declares it.
const S5_SLEEP_TYPE: u8 = 5;
/// The value the FADT's reset register description tells the guest to write for a reset.
pub const ACPI_RESET_VALUE: u8 = 1;

/// The ACPI hardware-reduced sleep control register (port 0x600).
///
/// An 8-bit write of `(5 << 2) | (1 << 5)` powers off; a write of [`ACPI_RESET_VALUE`]
/// resets (the same port serves as the FADT reset register). Reads return 0.
pub struct AcpiPowerDevice {
    sink: Arc<dyn GuestRequestSink>,
}

impl AcpiPowerDevice {
    /// Creates the register; power-off and reset requests go to `sink`.
    pub fn new(sink: Arc<dyn GuestRequestSink>) -> Self {
        Self { sink }
    }
}

impl BusDevice for AcpiPowerDevice {
    fn read(&mut self, _base: u64, _offset: u64, data: &mut [u8]) {
        data.fill(0);
    }

    fn write(&mut self, _base: u64, offset: u64, data: &[u8]) {
        let (0, Some(&value)) = (offset, data.first()) else {
            return;
        };
        if value == ACPI_RESET_VALUE {
            self.sink.request(GuestRequest::Reset);
        } else if value & SLP_EN_BIT != 0
            && (value >> SLP_TYP_SHIFT) & SLP_TYP_MASK == S5_SLEEP_TYPE
        {
            self.sink.request(GuestRequest::PowerOff);
        }
    }
}

/// pvpanic event bit: the guest panicked.
const PVPANIC_PANICKED: u8 = 1 << 0;
/// pvpanic event bit: a crash kernel is loaded (informational, the VM keeps running).
const PVPANIC_CRASH_LOADED: u8 = 1 << 1;

/// The pvpanic device (port 0x505), as QEMU's `pvpanic` ISA device.
///
/// Reads return the supported events; a write with bit 0 set reports a guest crash.
pub struct PvPanicDevice {
    sink: Arc<dyn GuestRequestSink>,
}

impl PvPanicDevice {
    /// Creates the device; crash reports go to `sink`.
    pub fn new(sink: Arc<dyn GuestRequestSink>) -> Self {
        Self { sink }
    }
}

impl BusDevice for PvPanicDevice {
    fn read(&mut self, _base: u64, _offset: u64, data: &mut [u8]) {
        data.fill(0);
        if let Some(first) = data.first_mut() {
            *first = PVPANIC_PANICKED | PVPANIC_CRASH_LOADED;
        }
    }

    fn write(&mut self, _base: u64, _offset: u64, data: &[u8]) {
        if data.first().is_some_and(|v| v & PVPANIC_PANICKED != 0) {
            self.sink.request(GuestRequest::Panic);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::legacy::test_utils::RecordingSink;

    fn requests(sink: &RecordingSink) -> Vec<GuestRequest> {
        sink.0.lock().unwrap().clone()
    }

    #[test]
    fn s5_with_slp_en_powers_off() {
        let sink = Arc::new(RecordingSink::default());
        let mut dev = AcpiPowerDevice::new(sink.clone());
        dev.write(0x600, 0, &[(5 << 2) | (1 << 5)]);
        assert_eq!(requests(&sink), vec![GuestRequest::PowerOff]);
    }

    #[test]
    fn reset_value_resets() {
        let sink = Arc::new(RecordingSink::default());
        let mut dev = AcpiPowerDevice::new(sink.clone());
        dev.write(0x600, 0, &[ACPI_RESET_VALUE]);
        assert_eq!(requests(&sink), vec![GuestRequest::Reset]);
    }

    #[test]
    fn other_sleep_states_and_missing_slp_en_are_ignored() {
        let sink = Arc::new(RecordingSink::default());
        let mut dev = AcpiPowerDevice::new(sink.clone());
        dev.write(0x600, 0, &[5 << 2]); // S5 without SLP_EN
        dev.write(0x600, 0, &[(3 << 2) | (1 << 5)]); // S3
        dev.write(0x600, 1, &[(5 << 2) | (1 << 5)]); // wrong offset
        dev.write(0x600, 0, &[]);
        assert!(requests(&sink).is_empty());
    }

    #[test]
    fn pvpanic_bit0_reports_crash_and_crash_loaded_does_not() {
        let sink = Arc::new(RecordingSink::default());
        let mut dev = PvPanicDevice::new(sink.clone());
        dev.write(0x505, 0, &[PVPANIC_CRASH_LOADED]);
        assert!(requests(&sink).is_empty());
        dev.write(0x505, 0, &[PVPANIC_PANICKED]);
        assert_eq!(requests(&sink), vec![GuestRequest::Panic]);
        let mut caps = [0u8; 1];
        dev.read(0x505, 0, &mut caps);
        assert_eq!(caps, [PVPANIC_PANICKED | PVPANIC_CRASH_LOADED]);
    }
}
