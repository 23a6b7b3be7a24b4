//! `tenantvm-ngram`: the CI inference payload. A word-level n-gram language model (trained
//! by `tenantvm-ngram train`) served over an OpenAI-compatible HTTP API inside the tenant's
//! VM: completions, chat completions, streaming as server-sent events, models by name from
//! the tenant's encrypted disk, and an optional prefix cache whose speed-up is real work
//! skipped. docs/guest-image.md describes the API and flags.

pub mod api;
pub mod generate;
pub mod history;
pub mod http;
pub mod inference;
pub mod model;
pub mod openai;
pub mod prefill;
pub mod registry;
pub mod server;
pub mod state;
pub mod stats;

pub use model::{IndexedModel, NgramModel};
pub use registry::{load_model_file, ModelSource, Registry};
pub use server::Server;
pub use state::ServeConfig;
