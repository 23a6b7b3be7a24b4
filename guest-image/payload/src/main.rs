//! `tenantvm-ngram`: train an n-gram model from text files, or serve models over an
//! OpenAI-compatible HTTP API (see docs/guest-image.md).
//!
//! ```text
//! tenantvm-ngram train --order 3 --out model.json corpus/*.txt
//! tenantvm-ngram serve --model model.json --models-dir /data/models --listen 127.0.0.1:8000
//! ```

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use anyhow::{bail, Context, Result};
use clap::{Parser, Subcommand, ValueEnum};

use tenantvm_ngram::http::HttpLimits;
use tenantvm_ngram::state::AppState;
use tenantvm_ngram::{load_model_file, ModelSource, NgramModel, Registry, ServeConfig, Server};

/// The CI inference payload of tenantvm: a word-level n-gram model.
#[derive(Parser)]
#[command(name = "tenantvm-ngram", version)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Count n-grams in text files and write a model file.
    Train(TrainArgs),
    /// Serve models over an OpenAI-compatible HTTP API.
    Serve(Box<ServeArgs>),
}

#[derive(clap::Args)]
struct TrainArgs {
    /// Longest n-gram counted (1-6).
    #[arg(long, default_value_t = 3)]
    order: usize,
    /// Where to write the model (JSON).
    #[arg(long)]
    out: PathBuf,
    /// UTF-8 text files (read in sorted order).
    #[arg(required = true)]
    files: Vec<PathBuf>,
}

#[derive(Clone, Copy, PartialEq, Eq, ValueEnum)]
enum OnOff {
    On,
    Off,
}

#[derive(clap::Args)]
struct ServeArgs {
    /// Address to listen on (port 0 picks a free port).
    #[arg(long, default_value = "127.0.0.1:8000")]
    listen: String,
    /// The built-in model file (in the image).
    #[arg(long)]
    model: Option<PathBuf>,
    /// Name of the built-in model.
    #[arg(long, default_value = "tenantvm-ngram")]
    name: String,
    /// Directory of pushed models: <DIR>/<name> (a model file) or <DIR>/<name>/model.json;
    /// names starting with '.' (e.g. the temporary .<name>.partial) are never read.
    /// Created if missing. Rescanned on GET /v1/models, on an unknown model name and on SIGHUP.
    #[arg(long)]
    models_dir: Option<PathBuf>,
    /// Directory for completions.jsonl (the record of prompts and completions).
    #[arg(long)]
    data_dir: Option<PathBuf>,
    /// Reuse the prefill of prompt prefixes seen before (the timing side channel a
    /// multi-tenant server must not share; on here only as a positive control).
    #[arg(long, value_enum, default_value = "off")]
    prefix_cache: OnOff,
    /// Memory budget of the prefix cache.
    #[arg(long, default_value_t = 64)]
    prefix_cache_mib: usize,
    /// Mixing rounds per token of prefill and decode: the cost model's knob (see
    /// docs/guest-image.md; 2048 rounds cost about 20 µs per token on a loaded 2-core VM).
    #[arg(long, default_value_t = tenantvm_ngram::prefill::DEFAULT_ROUNDS_PER_TOKEN,
          value_parser = clap::value_parser!(u32).range(1..=1_000_000))]
    prefill_rounds: u32,
    /// Generations running at once; more requests wait for a slot.
    #[arg(long, default_value_t = 8, value_parser = clap::value_parser!(u32).range(1..=1024))]
    max_concurrency: u32,
    /// Open client connections; more are answered 503 at once.
    #[arg(long, default_value_t = 64, value_parser = clap::value_parser!(u32).range(1..=65536))]
    max_connections: u32,
    /// How long a request waits for a generation slot before 503.
    #[arg(long, default_value_t = 30_000)]
    queue_timeout_ms: u64,
    /// Largest request body (413 beyond).
    #[arg(long, default_value_t = 1024 * 1024)]
    max_body_bytes: usize,
    /// Largest request header block (431 beyond).
    #[arg(long, default_value_t = 16 * 1024, value_parser = clap::value_parser!(u64).range(256..=1_048_576))]
    max_header_bytes: u64,
    /// A request must arrive whole within this (408 beyond).
    #[arg(long, default_value_t = 10_000, value_parser = clap::value_parser!(u64).range(1..))]
    read_timeout_ms: u64,
    /// A kept-alive connection is closed after this long without a request.
    #[arg(long, default_value_t = 5_000, value_parser = clap::value_parser!(u64).range(1..))]
    idle_timeout_ms: u64,
    /// Each write to the client must complete within this (a stalled reader frees its slot).
    #[arg(long, default_value_t = 30_000, value_parser = clap::value_parser!(u64).range(1..))]
    write_timeout_ms: u64,
    /// Largest max_tokens a request may ask for.
    #[arg(long, default_value_t = 4096)]
    max_tokens_limit: usize,
    /// Largest prompt tokens + max_tokens of one choice.
    #[arg(long, default_value_t = 262_144)]
    max_context_tokens: usize,
    /// Largest model file loaded.
    #[arg(long, default_value_t = 512 * 1024 * 1024)]
    max_model_bytes: u64,
    /// Inference requests rescan the models directory at most this often.
    #[arg(long, default_value_t = 1000)]
    rescan_interval_ms: u64,
}

fn train(a: TrainArgs) -> Result<()> {
    let mut files = a.files;
    files.sort();
    let mut text = String::new();
    for f in &files {
        text.push_str(
            &std::fs::read_to_string(f).with_context(|| format!("reading {}", f.display()))?,
        );
        text.push('\n');
    }
    let model = NgramModel::train(&text, a.order)?;
    let json = serde_json::to_vec(&model)?;
    std::fs::write(&a.out, json).with_context(|| format!("writing {}", a.out.display()))?;
    eprintln!(
        "trained order-{} model: {} words of vocabulary, {} contexts -> {}",
        a.order,
        model.vocab.len(),
        model.contexts.len(),
        a.out.display()
    );
    Ok(())
}

/// Rescans the models directory on SIGHUP. SIGHUP is blocked in every thread (the mask is
/// inherited, so this runs before any other thread starts) and taken here with sigwait.
fn rescan_on_sighup(state: Arc<AppState>) -> Result<()> {
    use nix::sys::signal::{SigSet, Signal};
    let mut set = SigSet::empty();
    set.add(Signal::SIGHUP);
    set.thread_block().context("blocking SIGHUP")?;
    std::thread::Builder::new()
        .name("tenantvm-ngram-sighup".into())
        .spawn(move || {
            while set.wait().is_ok() {
                state.registry.rescan();
                eprintln!(
                    "SIGHUP: {} models served, {} not servable",
                    state.registry.models().len(),
                    state.registry.problems().len()
                );
            }
        })?;
    Ok(())
}

fn serve(a: ServeArgs) -> Result<()> {
    if a.model.is_none() && a.models_dir.is_none() {
        bail!("give --model FILE (the built-in model), --models-dir DIR (pushed models), or both");
    }
    let max_model_bytes = a.max_model_bytes;
    let builtin = match &a.model {
        Some(path) => Some(
            load_model_file(&a.name, path, ModelSource::Builtin, max_model_bytes)
                .with_context(|| format!("loading the built-in model {}", path.display()))?,
        ),
        None => None,
    };
    if let Some(dir) = &a.models_dir {
        if let Err(e) = std::fs::create_dir_all(dir) {
            eprintln!(
                "warning: cannot create the models directory {}: {e}",
                dir.display()
            );
        }
    }
    let config = ServeConfig {
        http: HttpLimits {
            max_header_bytes: a.max_header_bytes as usize,
            max_body_bytes: a.max_body_bytes,
            read_timeout: Duration::from_millis(a.read_timeout_ms),
            idle_timeout: Duration::from_millis(a.idle_timeout_ms),
            write_timeout: Duration::from_millis(a.write_timeout_ms),
        },
        max_concurrency: a.max_concurrency as usize,
        max_connections: a.max_connections as usize,
        queue_timeout: Duration::from_millis(a.queue_timeout_ms),
        max_tokens: a.max_tokens_limit,
        max_context_tokens: a.max_context_tokens,
        prefill_rounds: a.prefill_rounds,
        prefix_cache_bytes: (a.prefix_cache == OnOff::On)
            .then(|| a.prefix_cache_mib.saturating_mul(1024 * 1024)),
        rescan_interval: Duration::from_millis(a.rescan_interval_ms),
        data_dir: a.data_dir.clone(),
    };
    let registry = Registry::new(builtin, a.models_dir.clone(), max_model_bytes);
    registry.rescan();
    let server = Server::bind(&a.listen, registry, config)
        .with_context(|| format!("listening on {}", a.listen))?;
    let state = server.state();
    rescan_on_sighup(Arc::clone(&state))?;
    if a.data_dir.is_some() {
        eprintln!("history: {} completions on record", state.history.count());
    }
    for m in state.registry.models() {
        eprintln!(
            "model {} ({:?}, {} words) from {}",
            m.name,
            m.source,
            m.model.model().vocab.len(),
            m.path.display()
        );
    }
    for p in state.registry.problems() {
        eprintln!("model {} not servable: {}", p.name, p.error);
    }
    eprintln!(
        "serving on http://{} (prefix cache {}, {} prefill rounds per token, max concurrency {})",
        server.local_addr()?,
        if state.prefiller.cache_enabled() {
            "on"
        } else {
            "off"
        },
        state.prefiller.rounds(),
        state.config.max_concurrency
    );
    server.run()?;
    Ok(())
}

fn main() -> Result<()> {
    match Cli::parse().command {
        Command::Train(a) => train(a),
        Command::Serve(a) => serve(*a),
    }
}
