//! `tenantvm-ngram`: train an n-gram model from text files, or serve one.
//!
//! ```text
//! tenantvm-ngram train --order 3 --out model.json corpus/*.txt
//! tenantvm-ngram serve --model model.json --listen 127.0.0.1:8000 [--data-dir /data]
//! ```

mod model;
mod server;

use std::net::TcpListener;
use std::path::PathBuf;
use std::sync::Arc;

use anyhow::{bail, Context, Result};

use model::NgramModel;
use server::Service;

const USAGE: &str = "usage: tenantvm-ngram train --order N --out MODEL FILE...\n       tenantvm-ngram serve --model MODEL --listen ADDR [--data-dir DIR] [--name NAME]";

fn value(args: &mut impl Iterator<Item = String>, flag: &str) -> Result<String> {
    args.next()
        .with_context(|| format!("{flag} needs a value\n{USAGE}"))
}

fn train(mut args: impl Iterator<Item = String>) -> Result<()> {
    let (mut order, mut out, mut files) = (3usize, None, Vec::new());
    while let Some(a) = args.next() {
        match a.as_str() {
            "--order" => {
                order = value(&mut args, "--order")?
                    .parse()
                    .context("--order must be a number")?
            }
            "--out" => out = Some(PathBuf::from(value(&mut args, "--out")?)),
            f if !f.starts_with("--") => files.push(PathBuf::from(f)),
            other => bail!("unknown flag {other}\n{USAGE}"),
        }
    }
    let out = out.with_context(|| format!("--out is required\n{USAGE}"))?;
    if files.is_empty() {
        bail!("no corpus files given\n{USAGE}");
    }
    files.sort();
    let mut text = String::new();
    for f in &files {
        text.push_str(
            &std::fs::read_to_string(f).with_context(|| format!("reading {}", f.display()))?,
        );
        text.push('\n');
    }
    let model = NgramModel::train(&text, order)?;
    let json = serde_json::to_vec(&model)?;
    std::fs::write(&out, json).with_context(|| format!("writing {}", out.display()))?;
    eprintln!(
        "trained order-{order} model: {} words of vocabulary, {} contexts -> {}",
        model.vocab.len(),
        model.contexts.len(),
        out.display()
    );
    Ok(())
}

fn serve(mut args: impl Iterator<Item = String>) -> Result<()> {
    let (mut model, mut listen, mut data_dir, mut name) = (
        None,
        "127.0.0.1:8000".to_string(),
        None,
        "tenantvm-ngram".to_string(),
    );
    while let Some(a) = args.next() {
        match a.as_str() {
            "--model" => model = Some(PathBuf::from(value(&mut args, "--model")?)),
            "--listen" => listen = value(&mut args, "--listen")?,
            "--data-dir" => data_dir = Some(PathBuf::from(value(&mut args, "--data-dir")?)),
            "--name" => name = value(&mut args, "--name")?,
            other => bail!("unknown flag {other}\n{USAGE}"),
        }
    }
    let path = model.with_context(|| format!("--model is required\n{USAGE}"))?;
    let bytes = std::fs::read(&path).with_context(|| format!("reading {}", path.display()))?;
    let model: NgramModel =
        serde_json::from_slice(&bytes).with_context(|| format!("parsing {}", path.display()))?;
    model.validate()?;
    let listener = TcpListener::bind(&listen).with_context(|| format!("listening on {listen}"))?;
    if let Some(dir) = &data_dir {
        let recorded =
            std::fs::read_to_string(dir.join("completions.jsonl")).map_or(0, |t| t.lines().count());
        eprintln!("history: {recorded} completions on record");
    }
    eprintln!(
        "serving {name} ({} words) on http://{listen}",
        model.vocab.len()
    );
    server::run(Arc::new(Service::new(name, model, data_dir)), listener)?;
    Ok(())
}

fn main() -> Result<()> {
    let mut args = std::env::args().skip(1);
    match args.next().as_deref() {
        Some("train") => train(args),
        Some("serve") => serve(args),
        _ => bail!("{USAGE}"),
    }
}
