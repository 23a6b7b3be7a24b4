//! Fixtures shared by the control plane's end-to-end tests.
#![allow(dead_code)]

pub mod daemon;
pub mod openapi;
