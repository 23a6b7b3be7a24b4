//! Fixtures shared by the control plane's end-to-end tests: a live daemon ([`daemon`]), the
//! `tenantvm` CLI against it ([`cli`]), its TLS front door from the client's side ([`tls`], [`tls_pair`]),
//! the Linux guest image set ([`guest_image`]), the llama.cpp engine's prepared files
//! ([`llama`]), the OpenAPI checker ([`openapi`]), the departure tests' helpers
//! ([`departure`]), the judges of an engine on the GPU ([`engine_on_gpu`]) and the runtime's: jails, cgroups and VMs without a daemon ([`runtime`]).
#![allow(dead_code)]

pub mod cli;
pub mod daemon;
pub mod departure;
pub mod engine_on_gpu;
pub mod guest_image;
pub mod llama;
pub mod openapi;
pub mod runtime;
pub mod tls;
pub mod tls_pair;
