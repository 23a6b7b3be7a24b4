//! The llama-cpp variant's test model generator
//! (guest-image/variants/llama-cpp/make-test-model.py): the same seed gives the same bytes,
//! another seed other bytes (the comparison can fail), and the file is a GGUF of the
//! llama architecture with the blocks, tensors and tokenizer asked for. Needs the pinned
//! Python tools in .cache/llama-cpp/venv (guest-image/variants/llama-cpp/prepare.sh --tools);
//! otherwise SKIP naming that command.

use std::path::{Path, PathBuf};
use std::process::Command;

fn repo_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}

fn python() -> Option<PathBuf> {
    let p = repo_root().join(".cache/llama-cpp/venv/bin/python");
    p.is_file().then_some(p)
}

fn generate(out: &Path, args: &[&str]) -> Vec<u8> {
    let status = Command::new(python().unwrap())
        .arg(repo_root().join("guest-image/variants/llama-cpp/make-test-model.py"))
        .arg(out)
        .args(args)
        .status()
        .unwrap();
    assert!(status.success(), "make-test-model.py failed: {status}");
    std::fs::read(out).unwrap()
}

/// A GGUF value, as far as the test reads them.
#[derive(Debug, PartialEq)]
enum Value {
    Int(i128),
    Float(f64),
    Bool(bool),
    Str(String),
    Array(usize),
}

struct Reader<'a> {
    b: &'a [u8],
    at: usize,
}

impl Reader<'_> {
    fn take(&mut self, n: usize) -> &[u8] {
        let s = &self.b[self.at..self.at + n];
        self.at += n;
        s
    }
    fn u32(&mut self) -> u32 {
        u32::from_le_bytes(self.take(4).try_into().unwrap())
    }
    fn u64(&mut self) -> u64 {
        u64::from_le_bytes(self.take(8).try_into().unwrap())
    }
    fn string(&mut self) -> String {
        let n = self.u64() as usize;
        String::from_utf8(self.take(n).to_vec()).unwrap()
    }
    fn value(&mut self, kind: u32) -> Value {
        match kind {
            0 | 1 => Value::Int(i128::from(self.take(1)[0])),
            2 | 3 => Value::Int(i128::from(u16::from_le_bytes(
                self.take(2).try_into().unwrap(),
            ))),
            4 | 5 => Value::Int(i128::from(self.u32())),
            6 => Value::Float(f64::from(f32::from_le_bytes(
                self.take(4).try_into().unwrap(),
            ))),
            7 => Value::Bool(self.take(1)[0] != 0),
            8 => Value::Str(self.string()),
            9 => {
                let item = self.u32();
                let n = self.u64() as usize;
                for _ in 0..n {
                    self.value(item);
                }
                Value::Array(n)
            }
            10 | 11 => Value::Int(i128::from(self.u64())),
            12 => Value::Float(f64::from_le_bytes(self.take(8).try_into().unwrap())),
            other => panic!("unknown GGUF value type {other}"),
        }
    }
}

/// The header's tensor count and metadata.
fn header(b: &[u8]) -> (u64, std::collections::BTreeMap<String, Value>) {
    assert_eq!(&b[..4], b"GGUF", "not a GGUF file");
    let mut r = Reader { b, at: 4 };
    assert_eq!(r.u32(), 3, "GGUF version");
    let tensors = r.u64();
    let kvs = r.u64();
    let mut meta = std::collections::BTreeMap::new();
    for _ in 0..kvs {
        let key = r.string();
        let kind = r.u32();
        meta.insert(key, r.value(kind));
    }
    (tensors, meta)
}

#[test]
fn the_test_model_is_a_llama_gguf_deterministic_from_its_seed() {
    if python().is_none() {
        tenantvm_skip::skip!(
            "no .cache/llama-cpp/venv: run guest-image/variants/llama-cpp/prepare.sh --tools"
        );
    }
    let dir = tempfile::tempdir().unwrap();
    let small = [
        "--blocks",
        "2",
        "--width",
        "32",
        "--ff",
        "64",
        "--heads",
        "2",
        "--kv-heads",
        "1",
    ];
    let a = generate(
        &dir.path().join("a.gguf"),
        &[&small[..], &["--seed", "7"]].concat(),
    );
    let b = generate(
        &dir.path().join("b.gguf"),
        &[&small[..], &["--seed", "7"]].concat(),
    );
    let c = generate(
        &dir.path().join("c.gguf"),
        &[&small[..], &["--seed", "8"]].concat(),
    );
    assert!(a == b, "the same seed gave different files");
    assert!(a != c, "another seed gave the same file");
    assert!(!dir.path().join("a.gguf.partial").exists());
    let (tensors, meta) = header(&a);
    // token_embd, output_norm, output and nine per block.
    assert_eq!(tensors, 3 + 9 * 2);
    assert_eq!(meta["general.architecture"], Value::Str("llama".into()));
    assert_eq!(meta["llama.block_count"], Value::Int(2));
    assert_eq!(meta["llama.embedding_length"], Value::Int(32));
    assert_eq!(meta["tokenizer.ggml.model"], Value::Str("llama".into()));
    // Three specials, 256 byte tokens, U+2581, 94 characters alone and after it, words.
    let Value::Array(n) = meta["tokenizer.ggml.tokens"] else {
        panic!("no token list")
    };
    assert!(n > 3 + 256 + 1 + 2 * 94, "{n} tokens");
    assert!(matches!(meta["tokenizer.chat_template"], Value::Str(_)));
}
