//! The i8042 keyboard controller, reduced to what a VM needs: its reset line.
//!
//! Writing 0xFE (pulse the CPU reset line) to the command port is how Linux and many boot
//! loaders reset the machine. Everything else reads as "no data, controller idle" so that
//! drivers probing the controller give up quickly instead of waiting.

use std::sync::Arc;

use super::{GuestRequest, GuestRequestSink, I8042_COMMAND_PORT};
use crate::bus::BusDevice;

/// The i8042 command that pulses the CPU reset line.
const CMD_RESET_CPU: u8 = 0xfe;

/// The i8042 controller on ports 0x60 (data) and 0x64 (command/status).
///
/// Register it on the bus as two 1-byte ranges; `base` tells the ports apart.
pub struct I8042Device {
    sink: Arc<dyn GuestRequestSink>,
}

impl I8042Device {
    /// Creates the controller; a reset command goes to `sink`.
    pub fn new(sink: Arc<dyn GuestRequestSink>) -> Self {
        Self { sink }
    }
}

impl BusDevice for I8042Device {
    fn read(&mut self, _base: u64, _offset: u64, data: &mut [u8]) {
        // Status: output buffer empty, input buffer empty. Data: nothing pending.
        data.fill(0);
    }

    fn write(&mut self, base: u64, offset: u64, data: &[u8]) {
        if base + offset == I8042_COMMAND_PORT && data.first() == Some(&CMD_RESET_CPU) {
            self.sink.request(GuestRequest::Reset);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::legacy::test_utils::RecordingSink;
    use crate::legacy::I8042_DATA_PORT;

    #[test]
    fn reset_command_on_command_port_requests_reset() {
        let sink = Arc::new(RecordingSink::default());
        let mut dev = I8042Device::new(sink.clone());
        dev.write(I8042_COMMAND_PORT, 0, &[0xfe]);
        assert_eq!(*sink.0.lock().unwrap(), vec![GuestRequest::Reset]);
    }

    #[test]
    fn other_writes_and_data_port_are_ignored() {
        let sink = Arc::new(RecordingSink::default());
        let mut dev = I8042Device::new(sink.clone());
        dev.write(I8042_COMMAND_PORT, 0, &[0xaa]);
        dev.write(I8042_DATA_PORT, 0, &[0xfe]);
        dev.write(I8042_COMMAND_PORT, 0, &[]);
        let mut status = [0xffu8; 1];
        dev.read(I8042_COMMAND_PORT, 0, &mut status);
        assert_eq!(status, [0]);
        assert!(sink.0.lock().unwrap().is_empty());
    }
}
