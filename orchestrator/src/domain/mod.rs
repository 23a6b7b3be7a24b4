//! What a tenant is, independent of how it is stored, served or run: its validated name
//! ([`name::TenantName`]), its spec ([`spec::TenantSpec`]), what runs in its guest
//! ([`guest::GuestKind`]), the write-only vGPU licence token ([`licence::VgpuLicence`]) and its lifecycle state machine ([`lifecycle::LifecycleState`]).
//!
//! These are plain values with no I/O. Every other layer may use them; they use nothing of
//! the crate but each other (and the tenant name rule, from the jail crate), so the store, the API types and the tenant layer can all depend
//! on them without depending on one another.

pub mod gpu_request;
pub mod guest;
pub mod licence;
pub mod lifecycle;
pub mod name;
pub mod spec;

pub use guest::GuestKind;
pub use lifecycle::LifecycleState;
pub use name::TenantName;
pub use spec::TenantSpec;
