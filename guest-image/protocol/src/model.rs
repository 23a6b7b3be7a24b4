//! A model pushed as a directory (a Hugging-Face layout: `config.json`, the tokenizer's
//! files, `*.safetensors` shards, in subdirectories too): its manifest, one
//! [`ModelFile`] per regular file, and the rule every side applies to it (the CLI that
//! writes it, the daemon that forwards it, the agent that stores it). The files' bytes
//! follow as one stream, in the manifest's order.

use serde::{Deserialize, Serialize};
use thiserror::Error;

/// Most files in one pushed directory.
pub const MAX_MODEL_FILES: usize = 4096;
/// Longest path of a file inside a pushed directory, in bytes.
pub const MAX_MODEL_PATH: usize = 1024;
/// Longest manifest (its JSON line), in bytes: [`MAX_MODEL_FILES`] entries of a long path.
pub const MAX_MANIFEST_BYTES: usize = 1 << 20;

/// One file of a pushed directory.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ModelFile {
    /// Its path inside the directory: `/`-separated components of `A-Z a-z 0-9 . _ - +`,
    /// none empty, `.` or `..` ([`valid_file_path`]).
    pub path: String,
    /// Exact size in bytes.
    pub size: u64,
    /// SHA-256 of its bytes, lowercase hex.
    pub sha256: String,
}

/// The manifest the client sends first: the files, in the order their bytes follow.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ModelManifest {
    /// The files.
    pub files: Vec<ModelFile>,
}

/// Why a manifest is refused.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
pub enum ManifestError {
    /// No files at all.
    #[error("the model directory holds no files")]
    Empty,
    /// Too many files.
    #[error("the model directory holds {0} files, more than {MAX_MODEL_FILES}")]
    TooMany(usize),
    /// A path that could leave the directory or is not a plain name.
    #[error("{0:?} is not a path inside the model directory (components of A-Z a-z 0-9 . _ - +, no '..', no '/' at either end, at most {MAX_MODEL_PATH} bytes)")]
    BadPath(String),
    /// A hash that is not 64 lowercase hex digits.
    #[error("the SHA-256 of {0:?} is not 64 lowercase hex digits")]
    BadHash(String),
    /// The same path twice, or a file where another needs a directory.
    #[error("{0:?} is named twice, or is both a file and a directory")]
    Clash(String),
    /// The sizes add up past what a u64 holds.
    #[error("the files' sizes overflow")]
    Overflow,
}

/// Whether `path` names a file inside a pushed directory: relative, `/`-separated, each
/// component 1-255 bytes of `A-Z a-z 0-9 . _ - +` and neither `.` nor `..`.
pub fn valid_file_path(path: &str) -> bool {
    !path.is_empty()
        && path.len() <= MAX_MODEL_PATH
        && path.split('/').all(|c| {
            (1..=255).contains(&c.len())
                && c != "."
                && c != ".."
                && c.bytes()
                    .all(|b| b.is_ascii_alphanumeric() || b"._-+".contains(&b))
        })
}

/// Whether `s` is a SHA-256 as the protocol writes it: 64 lowercase hex digits.
pub fn valid_sha256(s: &str) -> bool {
    s.len() == 64
        && s.bytes()
            .all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b))
}

/// Checks a manifest; returns the files' total size.
pub fn check_files(files: &[ModelFile]) -> Result<u64, ManifestError> {
    if files.is_empty() {
        return Err(ManifestError::Empty);
    }
    if files.len() > MAX_MODEL_FILES {
        return Err(ManifestError::TooMany(files.len()));
    }
    let mut total = 0u64;
    let mut names = std::collections::BTreeSet::new();
    for f in files {
        if !valid_file_path(&f.path) {
            return Err(ManifestError::BadPath(f.path.clone()));
        }
        if !valid_sha256(&f.sha256) {
            return Err(ManifestError::BadHash(f.path.clone()));
        }
        if !names.insert(f.path.as_str()) {
            return Err(ManifestError::Clash(f.path.clone()));
        }
        total = total.checked_add(f.size).ok_or(ManifestError::Overflow)?;
    }
    // A file may not also be a directory of another (`a` and `a/b`).
    for f in files {
        let mut prefix = f.path.as_str();
        while let Some((dir, _)) = prefix.rsplit_once('/') {
            if names.contains(dir) {
                return Err(ManifestError::Clash(dir.to_string()));
            }
            prefix = dir;
        }
    }
    Ok(total)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn file(path: &str, size: u64) -> ModelFile {
        ModelFile {
            path: path.into(),
            size,
            sha256: "a".repeat(64),
        }
    }

    #[test]
    fn a_hugging_face_layout_passes_and_its_size_is_the_sum() {
        let files = [
            file("config.json", 10),
            file("tokenizer.json", 20),
            file("model-00001-of-00002.safetensors", 1000),
            file("model-00002-of-00002.safetensors", 500),
            file("1_Pooling/config.json", 3),
            file(".gitattributes", 1),
        ];
        assert_eq!(check_files(&files), Ok(1534));
    }

    #[test]
    fn paths_that_leave_the_directory_or_clash_are_refused() {
        for bad in [
            "",
            "/etc/passwd",
            "../x",
            "a/../../x",
            "a/./b",
            "a//b",
            "a/",
            "sp ace",
            "é",
            "a\\b",
            "..",
        ] {
            assert_eq!(
                check_files(&[file(bad, 1)]),
                Err(ManifestError::BadPath(bad.into())),
                "{bad:?}"
            );
        }
        assert!(!valid_file_path(&"x".repeat(256)));
        assert!(matches!(
            check_files(&[file("a", 1), file("a", 2)]),
            Err(ManifestError::Clash(_))
        ));
        assert!(matches!(
            check_files(&[file("a", 1), file("a/b", 2)]),
            Err(ManifestError::Clash(_))
        ));
        assert_eq!(check_files(&[]), Err(ManifestError::Empty));
        let mut f = file("a", 1);
        f.sha256 = "A".repeat(64);
        assert!(matches!(check_files(&[f]), Err(ManifestError::BadHash(_))));
        assert_eq!(
            check_files(&[file("a", u64::MAX), file("b", 1)]),
            Err(ManifestError::Overflow)
        );
    }
}
