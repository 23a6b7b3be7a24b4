//! The completion record: with `--data-dir`, each prompt and completion is appended to
//! `<data-dir>/completions.jsonl` (the tenant's encrypted disk in the guest) and synced
//! before the answer is complete. It is the tenant's own data, on the tenant's own disk;
//! nothing of it goes to the log, which only says how many completions are on record.

use std::collections::BTreeMap;
use std::fs::OpenOptions;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::Mutex;

/// File name of the record.
pub const HISTORY_FILE: &str = "completions.jsonl";

/// Appends completions to the record, one JSON line each.
#[derive(Debug)]
pub struct History {
    path: Option<PathBuf>,
    lock: Mutex<()>,
}

impl History {
    /// A record in `data_dir`, or none.
    pub fn new(data_dir: Option<&Path>) -> Self {
        Self {
            path: data_dir.map(|d| d.join(HISTORY_FILE)),
            lock: Mutex::new(()),
        }
    }

    /// Completions on record now (0 without a record or file).
    pub fn count(&self) -> usize {
        self.path
            .as_ref()
            .and_then(|p| std::fs::read_to_string(p).ok())
            .map_or(0, |t| t.lines().count())
    }

    /// Appends one completion and syncs it.
    pub fn record(&self, prompt: &str, completion: &str) -> std::io::Result<()> {
        let Some(path) = &self.path else {
            return Ok(());
        };
        let _guard = self.lock.lock().unwrap_or_else(|p| p.into_inner());
        let mut f = OpenOptions::new().create(true).append(true).open(path)?;
        let mut line = BTreeMap::new();
        line.insert("prompt", prompt);
        line.insert("completion", completion);
        let mut text = serde_json::to_string(&line).map_err(std::io::Error::other)?;
        text.push('\n');
        f.write_all(text.as_bytes())?;
        f.sync_data()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn records_lines_and_counts_them() {
        let dir = tempfile::tempdir().unwrap();
        let h = History::new(Some(dir.path()));
        assert_eq!(h.count(), 0);
        h.record("a \"quoted\"\nprompt", " done").unwrap();
        h.record("b", " c").unwrap();
        assert_eq!(h.count(), 2);
        let text = std::fs::read_to_string(dir.path().join(HISTORY_FILE)).unwrap();
        let first: serde_json::Value = serde_json::from_str(text.lines().next().unwrap()).unwrap();
        assert_eq!(first["prompt"], "a \"quoted\"\nprompt");
        let none = History::new(None);
        none.record("x", "y").unwrap();
        assert_eq!(none.count(), 0);
    }
}
