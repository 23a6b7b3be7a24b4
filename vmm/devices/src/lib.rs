//! Device models of tenantvm-vmm.
//!
//! Everything here faces the guest: every register write, descriptor and packet is
//! hostile input. Devices validate what they read, answer malformed requests with an
//! error status and a counter, and never panic on guest input.

pub mod bus;
pub mod legacy;
