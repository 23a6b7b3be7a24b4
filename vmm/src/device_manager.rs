//! Builds the guest's buses and attaches the legacy platform devices to them.

use std::sync::{Arc, Mutex};

use tenantvm_devices::bus::{Bus, BusError};
use tenantvm_devices::legacy::{
    AcpiPowerDevice, GuestRequestSink, I8042Device, LegacyDeviceError, PvPanicDevice, SerialDevice,
    SerialOutput, ACPI_SLEEP_CONTROL_PORT, COM1_IRQ, COM1_LEN, COM1_PORT, I8042_COMMAND_PORT,
    I8042_DATA_PORT, PVPANIC_PORT,
};
use tenantvm_devices::virtio::ThreadInit;
use vmm_sys_util::eventfd::{EventFd, EFD_NONBLOCK};

use crate::vstate::vm::Vm;
use crate::vstate::VstateError;

/// Why devices could not be attached.
#[derive(Debug, thiserror::Error)]
pub enum DeviceManagerError {
    /// Two devices claim the same addresses.
    #[error("Device address conflict: {0}")]
    Bus(#[from] BusError),
    /// A legacy device could not be created.
    #[error(transparent)]
    Legacy(#[from] LegacyDeviceError),
    /// An interrupt could not be wired.
    #[error(transparent)]
    Vstate(#[from] VstateError),
    /// An eventfd could not be created.
    #[error("Cannot create an interrupt eventfd: {0}")]
    EventFd(#[source] std::io::Error),
}

/// Attaches COM1, the i8042, the ACPI power-off port and pvpanic to `pio`; requests to end
/// the VM go to `sink`. Returns the serial device, for its input thread.
pub fn attach_legacy_devices(
    vm: &Vm,
    pio: &mut Bus,
    serial_output: SerialOutput,
    sink: Arc<dyn GuestRequestSink>,
    serial_output_init: Option<ThreadInit>,
) -> Result<Arc<Mutex<SerialDevice>>, DeviceManagerError> {
    let irq = EventFd::new(EFD_NONBLOCK).map_err(DeviceManagerError::EventFd)?;
    vm.register_irqfd(&irq, COM1_IRQ)?;
    let serial = Arc::new(Mutex::new(SerialDevice::new(
        irq,
        serial_output,
        serial_output_init,
    )?));
    pio.insert(serial.clone(), COM1_PORT, COM1_LEN)?;
    let i8042 = Arc::new(Mutex::new(I8042Device::new(sink.clone())));
    pio.insert(i8042.clone(), I8042_DATA_PORT, 1)?;
    pio.insert(i8042, I8042_COMMAND_PORT, 1)?;
    // The sleep control register and, next to it, the sleep status register (reads 0).
    pio.insert(
        Arc::new(Mutex::new(AcpiPowerDevice::new(sink.clone()))),
        ACPI_SLEEP_CONTROL_PORT,
        2,
    )?;
    pio.insert(
        Arc::new(Mutex::new(PvPanicDevice::new(sink))),
        PVPANIC_PORT,
        1,
    )?;
    Ok(serial)
}
