//! The daemon's HTTP API on a Unix socket. Handlers turn requests into
//! [`crate::tenant::service::TenantCommand`]s and nothing else. Spec: docs/api/openapi.yaml.

pub mod types;
