//! The OpenAI-compatible surface: request parsing and validation, the chat template,
//! response and chunk shapes, and errors in OpenAI's shape.

pub mod chat;
pub mod error;
pub mod request;
pub mod response;

pub use error::ApiError;
