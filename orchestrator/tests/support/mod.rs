//! Fixtures shared by the control plane's end-to-end tests: a live daemon ([`daemon`]), the
//! `tenantvm` CLI against it ([`cli`]), its TLS front door from the client's side ([`tls`], [`tls_pair`]),
//! the Linux guest image set ([`guest_image`]), the llama.cpp engine's prepared files
//! ([`llama`]) and the OpenAPI checker ([`openapi`]).
#![allow(dead_code)]

pub mod cli;
pub mod daemon;
pub mod guest_image;
pub mod llama;
pub mod openapi;
pub mod tls;
pub mod tls_pair;
