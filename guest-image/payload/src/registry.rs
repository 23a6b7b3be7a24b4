//! The models this server can serve, by name: the built-in model (`--model`, from the
//! image) and the models pushed into the models directory (`--models-dir`, on the tenant's
//! encrypted disk).
//!
//! **Layout.** A pushed model named `NAME` is the entry `<models-dir>/NAME`: either a
//! directory holding `model.json`, or a regular file that is itself the model JSON (the
//! format `tenantvm-ngram train` writes). `NAME` is 1-64 characters of `A-Z a-z 0-9 . _ -`,
//! not starting with `.`. Entries whose name starts with `.` are never read: a writer puts
//! a model in place under a temporary name `.NAME.partial` (file or directory), fsyncs it
//! and the directory, then renames it to `NAME`, so this server never sees half a model.
//!
//! **Rescans** cost a `readdir` and a `stat` per entry: a model is (re)loaded only when
//! its file's identity (device, inode, size, mtime) changed, and a malformed model is kept
//! as an error for its name (shown by `GET /v1/tenantvm/serving`, returned to requests that
//! name it), never taking the server down.

use std::collections::BTreeMap;
use std::fs;
use std::io::Read;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, RwLock};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use serde::Serialize;
use thiserror::Error;

use crate::model::{IndexedModel, NgramModel, NgramModelError};

/// File name of a model inside a pushed model directory.
pub const MODEL_FILE: &str = "model.json";
/// Suffix of the temporary name a writer uses (after a leading `.`).
pub const PARTIAL_SUFFIX: &str = ".partial";
/// Most entries considered in the models directory.
pub const MAX_PUSHED_MODELS: usize = 256;

/// Every loaded model gets a process-unique id (the prefix cache keys on it).
static NEXT_LOAD_ID: AtomicU64 = AtomicU64::new(1);

/// Why a model could not be loaded.
#[derive(Debug, Error)]
pub enum ModelLoadError {
    /// Reading failed.
    #[error("Cannot read {path}: {source}")]
    Read {
        /// The file.
        path: PathBuf,
        /// Why.
        source: std::io::Error,
    },
    /// Bigger than `--max-model-bytes`.
    #[error("{path} is {size} bytes; this server loads models of at most {max} bytes (--max-model-bytes)")]
    TooLarge {
        /// The file.
        path: PathBuf,
        /// Its size.
        size: u64,
        /// The limit.
        max: u64,
    },
    /// Not a model file.
    #[error(
        "{path} is not an n-gram model file ({source}); write one with `tenantvm-ngram train`"
    )]
    Parse {
        /// The file.
        path: PathBuf,
        /// Why.
        source: serde_json::Error,
    },
    /// Parsed, but inconsistent.
    #[error("{path}: {source}")]
    Invalid {
        /// The file.
        path: PathBuf,
        /// Why.
        source: NgramModelError,
    },
    /// A directory without `model.json`.
    #[error("{0} is a directory without {MODEL_FILE}")]
    NoModelFile(PathBuf),
    /// Neither a file nor a directory.
    #[error("{0} is neither a regular file nor a directory")]
    NotAFile(PathBuf),
    /// A name this server does not serve.
    #[error("The name {0:?} is not a valid model name: use 1-64 characters of A-Z a-z 0-9 . _ - not starting with '.'")]
    BadName(String),
    /// The built-in model's name.
    #[error("The name {0:?} belongs to the built-in model; push under another name")]
    NameTaken(String),
    /// Too many entries.
    #[error(
        "The models directory holds more than {MAX_PUSHED_MODELS} entries; this one is ignored"
    )]
    TooMany,
}

/// Where a model came from.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum ModelSource {
    /// `--model`: part of the image.
    Builtin,
    /// Pushed into `--models-dir`.
    Pushed,
}

/// A model ready to serve.
#[derive(Debug)]
pub struct LoadedModel {
    /// The name requests use.
    pub name: String,
    /// Process-unique id of this load.
    pub load_id: u64,
    /// Built in or pushed.
    pub source: ModelSource,
    /// Unix seconds: the file's modification time.
    pub created: u64,
    /// The file it was read from.
    pub path: PathBuf,
    /// The model.
    pub model: IndexedModel,
}

/// Identity of a model file, to notice replacement.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct FileId {
    dev: u64,
    ino: u64,
    size: u64,
    mtime_ns: i128,
}

impl FileId {
    fn of(meta: &fs::Metadata) -> Self {
        Self {
            dev: meta.dev(),
            ino: meta.ino(),
            size: meta.size(),
            mtime_ns: i128::from(meta.mtime()) * 1_000_000_000 + i128::from(meta.mtime_nsec()),
        }
    }
}

/// A pushed entry's state after the last scan.
#[derive(Debug, Clone)]
enum Pushed {
    Ready(FileId, Arc<LoadedModel>),
    Broken(Option<FileId>, Arc<str>),
}

/// A model that could not be loaded, as reported to clients.
#[derive(Debug, Clone, Serialize, PartialEq, Eq)]
pub struct ModelProblem {
    /// The entry's name.
    pub name: String,
    /// Why it is not served.
    pub error: String,
}

/// What a request for a model finds.
#[derive(Debug, Clone)]
pub enum Lookup {
    /// Serve with this.
    Found(Arc<LoadedModel>),
    /// The name exists but the model is broken.
    Broken(String),
    /// No such model.
    Missing,
}

/// The built-in and pushed models.
#[derive(Debug)]
pub struct Registry {
    builtin: Option<Arc<LoadedModel>>,
    models_dir: Option<PathBuf>,
    max_model_bytes: u64,
    pushed: RwLock<BTreeMap<String, Pushed>>,
    /// Serialises scans; holds the time of the last one.
    scan: Mutex<Option<Instant>>,
}

/// Is `name` a name a pushed model may have?
pub fn is_valid_model_name(name: &str) -> bool {
    (1..=64).contains(&name.len())
        && !name.starts_with('.')
        && name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b"._-".contains(&b))
}

fn unix_secs(t: SystemTime) -> u64 {
    t.duration_since(UNIX_EPOCH).map_or(0, |d| d.as_secs())
}

/// Reads, parses, validates and indexes the model file at `path`.
pub fn load_model_file(
    name: &str,
    path: &Path,
    source: ModelSource,
    max_bytes: u64,
) -> Result<LoadedModel, ModelLoadError> {
    let read_err = |source| ModelLoadError::Read {
        path: path.to_path_buf(),
        source,
    };
    let file = fs::File::open(path).map_err(read_err)?;
    let meta = file.metadata().map_err(read_err)?;
    if !meta.is_file() {
        return Err(ModelLoadError::NotAFile(path.to_path_buf()));
    }
    if meta.len() > max_bytes {
        return Err(ModelLoadError::TooLarge {
            path: path.to_path_buf(),
            size: meta.len(),
            max: max_bytes,
        });
    }
    let mut bytes = Vec::with_capacity(meta.len() as usize);
    file.take(max_bytes + 1)
        .read_to_end(&mut bytes)
        .map_err(read_err)?;
    if bytes.len() as u64 > max_bytes {
        return Err(ModelLoadError::TooLarge {
            path: path.to_path_buf(),
            size: bytes.len() as u64,
            max: max_bytes,
        });
    }
    let model: NgramModel =
        serde_json::from_slice(&bytes).map_err(|source| ModelLoadError::Parse {
            path: path.to_path_buf(),
            source,
        })?;
    let model = IndexedModel::new(model).map_err(|source| ModelLoadError::Invalid {
        path: path.to_path_buf(),
        source,
    })?;
    Ok(LoadedModel {
        name: name.to_string(),
        load_id: NEXT_LOAD_ID.fetch_add(1, Ordering::Relaxed),
        source,
        created: meta.modified().map_or(0, unix_secs),
        path: path.to_path_buf(),
        model,
    })
}

/// The model file of entry `entry` and its identity, following one level (dir/model.json).
fn model_file_of(entry: &Path) -> Result<(PathBuf, FileId), (Option<FileId>, ModelLoadError)> {
    let meta = fs::metadata(entry).map_err(|source| {
        (
            None,
            ModelLoadError::Read {
                path: entry.to_path_buf(),
                source,
            },
        )
    })?;
    if meta.is_file() {
        return Ok((entry.to_path_buf(), FileId::of(&meta)));
    }
    if !meta.is_dir() {
        return Err((None, ModelLoadError::NotAFile(entry.to_path_buf())));
    }
    let file = entry.join(MODEL_FILE);
    match fs::metadata(&file) {
        Ok(m) if m.is_file() => Ok((file, FileId::of(&m))),
        Ok(_) => Err((None, ModelLoadError::NotAFile(file))),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            Err((None, ModelLoadError::NoModelFile(entry.to_path_buf())))
        }
        Err(source) => Err((None, ModelLoadError::Read { path: file, source })),
    }
}

impl Registry {
    /// A registry with an optional built-in model and an optional models directory.
    pub fn new(
        builtin: Option<LoadedModel>,
        models_dir: Option<PathBuf>,
        max_model_bytes: u64,
    ) -> Self {
        Self {
            builtin: builtin.map(Arc::new),
            models_dir,
            max_model_bytes,
            pushed: RwLock::new(BTreeMap::new()),
            scan: Mutex::new(None),
        }
    }

    /// The models directory, if any.
    pub fn models_dir(&self) -> Option<&Path> {
        self.models_dir.as_deref()
    }

    /// Rescans the models directory now (waits for a scan in progress).
    pub fn rescan(&self) {
        let mut last = self.scan.lock().unwrap_or_else(|p| p.into_inner());
        self.scan_locked();
        *last = Some(Instant::now());
    }

    /// Rescans unless one ran within `interval` or is running now.
    pub fn rescan_if_older_than(&self, interval: Duration) {
        let Ok(mut last) = self.scan.try_lock() else {
            return;
        };
        if last.is_some_and(|t| t.elapsed() < interval) {
            return;
        }
        self.scan_locked();
        *last = Some(Instant::now());
    }

    fn scan_locked(&self) {
        let Some(dir) = &self.models_dir else {
            return;
        };
        let previous = self
            .pushed
            .read()
            .unwrap_or_else(|p| p.into_inner())
            .clone();
        let mut next = BTreeMap::new();
        let names: Vec<String> = match fs::read_dir(dir) {
            Ok(entries) => {
                let mut names: Vec<String> = entries
                    .filter_map(Result::ok)
                    .map(|e| e.file_name().to_string_lossy().into_owned())
                    .filter(|n| !n.starts_with('.'))
                    .collect();
                names.sort();
                names
            }
            // No directory yet (nothing pushed): no pushed models.
            Err(_) => Vec::new(),
        };
        for (i, name) in names.into_iter().enumerate() {
            let broken = |id, e: ModelLoadError| Pushed::Broken(id, Arc::from(e.to_string()));
            let state = if i >= MAX_PUSHED_MODELS {
                broken(None, ModelLoadError::TooMany)
            } else if !is_valid_model_name(&name) {
                broken(None, ModelLoadError::BadName(name.clone()))
            } else if self.builtin.as_ref().is_some_and(|b| b.name == name) {
                broken(None, ModelLoadError::NameTaken(name.clone()))
            } else {
                match model_file_of(&dir.join(&name)) {
                    Err((id, e)) => broken(id, e),
                    Ok((path, id)) => match previous.get(&name) {
                        Some(p @ Pushed::Ready(old, _)) if *old == id => p.clone(),
                        Some(p @ Pushed::Broken(Some(old), _)) if *old == id => p.clone(),
                        _ => match load_model_file(
                            &name,
                            &path,
                            ModelSource::Pushed,
                            self.max_model_bytes,
                        ) {
                            Ok(m) => Pushed::Ready(id, Arc::new(m)),
                            Err(e) => broken(Some(id), e),
                        },
                    },
                }
            };
            next.insert(name, state);
        }
        *self.pushed.write().unwrap_or_else(|p| p.into_inner()) = next;
    }

    /// The model to use for `name`, or the default model when `name` is `None`.
    pub fn lookup(&self, name: Option<&str>) -> Lookup {
        let Some(name) = name else {
            return match self.default_model() {
                Some(m) => Lookup::Found(m),
                None => Lookup::Missing,
            };
        };
        if let Some(b) = self.builtin.as_ref().filter(|b| b.name == name) {
            return Lookup::Found(Arc::clone(b));
        }
        match self
            .pushed
            .read()
            .unwrap_or_else(|p| p.into_inner())
            .get(name)
        {
            Some(Pushed::Ready(_, m)) => Lookup::Found(Arc::clone(m)),
            Some(Pushed::Broken(_, e)) => Lookup::Broken(e.to_string()),
            None => Lookup::Missing,
        }
    }

    /// The built-in model, else the only pushed model.
    pub fn default_model(&self) -> Option<Arc<LoadedModel>> {
        if let Some(b) = &self.builtin {
            return Some(Arc::clone(b));
        }
        let pushed = self.pushed.read().unwrap_or_else(|p| p.into_inner());
        let mut ready = pushed.values().filter_map(|p| match p {
            Pushed::Ready(_, m) => Some(m),
            Pushed::Broken(..) => None,
        });
        match (ready.next(), ready.next()) {
            (Some(m), None) => Some(Arc::clone(m)),
            _ => None,
        }
    }

    /// Every servable model: the built-in one first, then the pushed ones by name.
    pub fn models(&self) -> Vec<Arc<LoadedModel>> {
        let pushed = self.pushed.read().unwrap_or_else(|p| p.into_inner());
        self.builtin
            .iter()
            .cloned()
            .chain(pushed.values().filter_map(|p| match p {
                Pushed::Ready(_, m) => Some(Arc::clone(m)),
                Pushed::Broken(..) => None,
            }))
            .collect()
    }

    /// Pushed entries that are not served, and why.
    pub fn problems(&self) -> Vec<ModelProblem> {
        let pushed = self.pushed.read().unwrap_or_else(|p| p.into_inner());
        pushed
            .iter()
            .filter_map(|(name, p)| match p {
                Pushed::Broken(_, e) => Some(ModelProblem {
                    name: name.clone(),
                    error: e.to_string(),
                }),
                Pushed::Ready(..) => None,
            })
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const TEXT: &str = "The cat sat on the mat. The dog sat on the log.";

    fn write_model(path: &Path, text: &str) {
        let m = NgramModel::train(text, 2).unwrap();
        fs::write(path, serde_json::to_vec(&m).unwrap()).unwrap();
    }

    fn builtin(dir: &Path) -> LoadedModel {
        let p = dir.join("builtin.json");
        write_model(&p, TEXT);
        load_model_file("base", &p, ModelSource::Builtin, 1 << 20).unwrap()
    }

    #[test]
    fn names_follow_the_documented_rule() {
        for ok in ["a", "my-model_2.1", &"x".repeat(64)] {
            assert!(is_valid_model_name(ok), "{ok}");
        }
        for bad in [
            "",
            ".hidden",
            ".m.partial",
            "a/b",
            "a b",
            "é",
            &"x".repeat(65),
            "..",
        ] {
            assert!(!is_valid_model_name(bad), "{bad}");
        }
    }

    #[test]
    fn scan_serves_files_and_directories_and_skips_temporary_names() {
        let tmp = tempfile::tempdir().unwrap();
        let models = tmp.path().join("models");
        fs::create_dir(&models).unwrap();
        write_model(&models.join("single"), "Alpha beta gamma.");
        fs::create_dir(models.join("dir")).unwrap();
        write_model(&models.join("dir").join(MODEL_FILE), "Delta epsilon.");
        // A push in progress: never read, even though it is a valid model.
        write_model(&models.join(".late.partial"), "Zeta eta.");
        fs::create_dir(models.join(".other.partial")).unwrap();

        let r = Registry::new(Some(builtin(tmp.path())), Some(models.clone()), 1 << 20);
        r.rescan();
        let names: Vec<String> = r.models().iter().map(|m| m.name.clone()).collect();
        assert_eq!(names, ["base", "dir", "single"]);
        assert!(r.problems().is_empty(), "{:?}", r.problems());
        assert!(matches!(r.lookup(Some("late")), Lookup::Missing));
        assert!(matches!(r.lookup(Some(".late.partial")), Lookup::Missing));
        let Lookup::Found(m) = r.lookup(None) else {
            panic!("the built-in model is the default")
        };
        assert_eq!(m.name, "base");

        // The writer's rename makes it appear on the next scan.
        fs::rename(models.join(".late.partial"), models.join("late")).unwrap();
        r.rescan();
        assert!(matches!(r.lookup(Some("late")), Lookup::Found(_)));
    }

    #[test]
    fn malformed_models_are_errors_for_their_name_only() {
        let tmp = tempfile::tempdir().unwrap();
        let models = tmp.path().join("models");
        fs::create_dir(&models).unwrap();
        write_model(&models.join("good"), TEXT);
        fs::write(models.join("garbage"), b"{not json").unwrap();
        fs::write(
            models.join("wrong"),
            br#"{"order": 9, "vocab": [], "contexts": []}"#,
        )
        .unwrap();
        fs::create_dir(models.join("empty")).unwrap();
        fs::write(models.join("bad name"), b"{}").unwrap();
        fs::write(models.join("base"), b"{}").unwrap();
        let many_words: String = (0..2000).map(|i| format!("w{i} ")).collect();
        write_model(&models.join("huge"), &many_words);

        let r = Registry::new(Some(builtin(tmp.path())), Some(models), 4096);
        r.rescan();
        assert!(matches!(r.lookup(Some("good")), Lookup::Found(_)));
        let problems: BTreeMap<String, String> = r
            .problems()
            .into_iter()
            .map(|p| (p.name, p.error))
            .collect();
        assert!(
            problems["garbage"].contains("not an n-gram model file"),
            "{problems:?}"
        );
        assert!(problems["wrong"].contains("order 9"), "{problems:?}");
        assert!(
            problems["empty"].contains("without model.json"),
            "{problems:?}"
        );
        assert!(
            problems["bad name"].contains("not a valid model name"),
            "{problems:?}"
        );
        assert!(problems["base"].contains("built-in"), "{problems:?}");
        assert!(
            problems["huge"].contains("--max-model-bytes"),
            "{problems:?}"
        );
        let Lookup::Broken(e) = r.lookup(Some("garbage")) else {
            panic!("a broken model is reported as broken")
        };
        assert!(e.contains("garbage"));
        // The built-in model still answers; the good pushed one too.
        assert!(matches!(r.lookup(Some("base")), Lookup::Found(_)));
    }

    #[test]
    fn unchanged_files_are_not_reloaded_and_replaced_ones_are() {
        let tmp = tempfile::tempdir().unwrap();
        let models = tmp.path().join("models");
        fs::create_dir(&models).unwrap();
        write_model(&models.join("m"), TEXT);
        let r = Registry::new(None, Some(models.clone()), 1 << 20);
        r.rescan();
        let Lookup::Found(first) = r.lookup(Some("m")) else {
            panic!()
        };
        r.rescan();
        let Lookup::Found(again) = r.lookup(Some("m")) else {
            panic!()
        };
        assert_eq!(first.load_id, again.load_id, "an unchanged file is kept");
        // Replaced the way a push does it: a temporary name, then rename.
        write_model(&models.join(".m.partial"), "Other words entirely.");
        fs::rename(models.join(".m.partial"), models.join("m")).unwrap();
        r.rescan();
        let Lookup::Found(replaced) = r.lookup(Some("m")) else {
            panic!()
        };
        assert_ne!(first.load_id, replaced.load_id);
        assert!(replaced.model.token_id("entirely").is_some());
        // With no built-in model, the only pushed model is the default.
        assert!(matches!(r.lookup(None), Lookup::Found(_)));
        write_model(&models.join("second"), TEXT);
        r.rescan();
        assert!(matches!(r.lookup(None), Lookup::Missing));
    }

    #[test]
    fn a_missing_models_directory_means_no_pushed_models() {
        let tmp = tempfile::tempdir().unwrap();
        let r = Registry::new(None, Some(tmp.path().join("absent")), 1 << 20);
        r.rescan();
        assert!(r.models().is_empty());
        assert!(r.problems().is_empty());
    }
}
