//! Legacy ISA devices of the x86_64 platform: COM1 (16550), the i8042 reset line, the ACPI
//! sleep-control power-off port and pvpanic.
//!
//! Port assignments are part of the VMM contract (docs/vmm.md). Devices that end the VM do
//! not act on the VMM directly: they report a [`GuestRequest`] to a [`GuestRequestSink`],
//! which the VM lifecycle code owns.

mod i8042;
mod power;
mod serial;
mod serial_out;

pub use i8042::I8042Device;
pub use power::{AcpiPowerDevice, PvPanicDevice, ACPI_RESET_VALUE};
pub use serial::{spawn_input_thread, IrqTrigger, SerialDevice, SerialOutput, SERIAL_FILE_LIMIT};
pub use serial_out::{BatchedOutput, OutputFlush, BATCH_BYTES, FLUSH_DELAY};

/// COM1 base I/O port.
pub const COM1_PORT: u64 = 0x3f8;
/// COM1 port range length.
pub const COM1_LEN: u64 = 8;
/// COM1 interrupt line (GSI on the in-kernel IOAPIC/PIC).
pub const COM1_IRQ: u32 = 4;
/// i8042 data port.
pub const I8042_DATA_PORT: u64 = 0x60;
/// i8042 command/status port.
pub const I8042_COMMAND_PORT: u64 = 0x64;
/// ACPI hardware-reduced sleep control (and reset) register.
pub const ACPI_SLEEP_CONTROL_PORT: u64 = 0x600;
/// ACPI hardware-reduced sleep status register (reads 0).
pub const ACPI_SLEEP_STATUS_PORT: u64 = 0x601;
/// pvpanic I/O port.
pub const PVPANIC_PORT: u64 = 0x505;

/// A request from the guest that ends the VM.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum GuestRequest {
    /// Clean power-off (ACPI S5).
    PowerOff,
    /// Reset (i8042 0xFE or the ACPI reset register).
    Reset,
    /// The guest reported a crash through pvpanic.
    Panic,
}

/// Receives the guest's requests to end the VM. Implemented by the VMM.
pub trait GuestRequestSink: Send + Sync {
    /// Records `request`; the first request wins, later ones are ignored.
    fn request(&self, request: GuestRequest);
}

/// Errors of the legacy devices' host side.
#[derive(Debug, thiserror::Error)]
pub enum LegacyDeviceError {
    /// Creating an eventfd failed.
    #[error("Cannot create an eventfd for a legacy device")]
    EventFd(#[source] std::io::Error),
    /// Starting the serial input thread failed.
    #[error("Cannot start the serial input thread")]
    SpawnInput(#[source] std::io::Error),
    /// Starting the serial output flusher thread failed.
    #[error("Cannot start the serial output thread")]
    SpawnOutput(#[source] std::io::Error),
}

#[cfg(test)]
pub(crate) mod test_utils {
    use super::{GuestRequest, GuestRequestSink};
    use std::sync::Mutex;

    /// A sink that records every request, for tests.
    #[derive(Default)]
    pub struct RecordingSink(pub Mutex<Vec<GuestRequest>>);

    impl GuestRequestSink for RecordingSink {
        fn request(&self, request: GuestRequest) {
            self.0.lock().unwrap().push(request);
        }
    }
}
