//! The tenant's own models on its encrypted disk: `<data>/models/NAME`, where the payload
//! serves them by name (guest-image/payload/src/registry.rs). A push is written under the
//! temporary name `.NAME.partial` (which the payload never reads), checked against the
//! announced size and SHA-256, fsynced, renamed into place and the directory fsynced: the
//! payload sees the whole model or none of it, and a push that breaks off, does not match
//! or fills the disk leaves nothing behind.

use std::fs::{self, File, OpenOptions};
use std::io::{self, Read, Write};
use std::path::{Path, PathBuf};

use sha2::{Digest, Sha256};
use thiserror::Error;

use tenantvm_agent_protocol::model::check_files;
use tenantvm_agent_protocol::{
    read_frame, ErrorCode, FrameError, ManifestError, ModelEntry, ModelFile,
};

/// The models directory under the data mount point.
pub const MODELS_DIR: &str = "models";
/// Kept free on the disk beyond a model's size.
pub const SPACE_MARGIN: u64 = 1 << 20;

/// Why a model could not be stored, listed or removed.
#[derive(Debug, Error)]
pub enum ModelError {
    /// A name the payload would not serve.
    #[error("Model name {0:?} is not 1-64 characters of A-Z a-z 0-9 . _ - starting with a letter, digit or _")]
    BadName(String),
    /// A model directory's manifest the agent will not store.
    #[error("The model directory is refused: {0}")]
    BadManifest(ManifestError),
    /// The announced hash is not 64 hex digits.
    #[error("The SHA-256 must be 64 lowercase hex digits")]
    BadHash,
    /// Not enough room.
    #[error("The data disk has {free} bytes free; the model needs {need} (with a {SPACE_MARGIN}-byte margin); remove a model or use a larger disk_gib")]
    NoSpace {
        /// Bytes needed.
        need: u64,
        /// Bytes free.
        free: u64,
    },
    /// What arrived is not what was announced.
    #[error("The model received does not match: {0}; nothing was stored, push it again")]
    Mismatch(String),
    /// No such model.
    #[error("No model named {0:?} is stored")]
    NotFound(String),
    /// The transfer broke off.
    #[error("The transfer broke off ({0}); nothing was stored, push it again")]
    Transfer(FrameError),
    /// The file system failed.
    #[error("Storing the model failed: {0}; nothing was stored")]
    Io(#[from] io::Error),
}

impl ModelError {
    /// The protocol's error code for it.
    pub fn code(&self) -> ErrorCode {
        match self {
            ModelError::BadName(_) | ModelError::BadHash | ModelError::BadManifest(_) => {
                ErrorCode::BadRequest
            }
            ModelError::NoSpace { .. } => ErrorCode::NoSpace,
            ModelError::Mismatch(_) => ErrorCode::Mismatch,
            ModelError::NotFound(_) => ErrorCode::NotFound,
            ModelError::Transfer(_) | ModelError::Io(_) => ErrorCode::Internal,
        }
    }
}

/// Whether the payload serves a model under `name`.
pub fn valid_name(name: &str) -> bool {
    (1..=64).contains(&name.len())
        && !name.starts_with('.')
        && name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b"._-".contains(&b))
}

fn partial(dir: &Path, name: &str) -> PathBuf {
    dir.join(format!(".{name}.partial"))
}

/// Free bytes on the file system of `dir`.
pub fn free_bytes(dir: &Path) -> io::Result<u64> {
    let st = nix::sys::statvfs::statvfs(dir).map_err(io::Error::from)?;
    #[allow(clippy::unnecessary_cast)]
    Ok((st.blocks_available() as u64).saturating_mul(st.fragment_size() as u64))
}

/// Checks a push before its data is asked for: the name, the hash, the room.
pub fn check(dir: &Path, name: &str, size: u64, sha256: &str, free: u64) -> Result<(), ModelError> {
    if !valid_name(name) {
        return Err(ModelError::BadName(name.to_string()));
    }
    if sha256.len() != 64
        || !sha256
            .bytes()
            .all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b))
    {
        return Err(ModelError::BadHash);
    }
    let need = size.saturating_add(SPACE_MARGIN);
    if need > free {
        return Err(ModelError::NoSpace { need, free });
    }
    fs::create_dir_all(dir)?;
    Ok(())
}

/// Reads the data frames of a push from `r` (an empty frame ends it) into
/// `<dir>/.NAME.partial`, checks them and renames the file to `<dir>/NAME`. On any failure
/// the partial file is removed. Returns the bytes stored and their SHA-256.
pub fn receive(
    dir: &Path,
    name: &str,
    size: u64,
    sha256: &str,
    r: &mut impl Read,
) -> Result<(u64, String), ModelError> {
    let tmp = partial(dir, name);
    let result = write_partial(&tmp, size, sha256, r).and_then(|stored| {
        let target = dir.join(name);
        if target.is_dir() {
            fs::remove_dir_all(&target)?;
        }
        fs::rename(&tmp, &target)?;
        File::open(dir)?.sync_all()?;
        Ok(stored)
    });
    if result.is_err() {
        let _ = fs::remove_file(&tmp);
    }
    result
}

fn write_partial(
    tmp: &Path,
    size: u64,
    sha256: &str,
    r: &mut impl Read,
) -> Result<(u64, String), ModelError> {
    let _ = fs::remove_file(tmp);
    let mut file = OpenOptions::new().write(true).create_new(true).open(tmp)?;
    let mut hasher = Sha256::new();
    let mut written = 0u64;
    loop {
        let data = read_frame(r).map_err(ModelError::Transfer)?;
        if data.is_empty() {
            break;
        }
        written = written.saturating_add(data.len() as u64);
        if written > size {
            return Err(ModelError::Mismatch(format!(
                "more than the announced {size} bytes"
            )));
        }
        hasher.update(&data[..]);
        file.write_all(&data).map_err(|e| {
            if e.raw_os_error() == Some(libc::ENOSPC) {
                ModelError::NoSpace {
                    need: size,
                    free: 0,
                }
            } else {
                ModelError::Io(e)
            }
        })?;
    }
    if written != size {
        return Err(ModelError::Mismatch(format!(
            "{written} bytes, {size} announced"
        )));
    }
    let got = hex::encode(hasher.finalize());
    if got != sha256 {
        return Err(ModelError::Mismatch(format!(
            "SHA-256 {got}, {sha256} announced"
        )));
    }
    file.sync_all()?;
    Ok((written, got))
}

/// Checks a directory push before its data is asked for: the name, every path
/// ([`tenantvm_agent_protocol::model::check_files`]), the hash's form, that `size` is the
/// files' total, and the room for it.
pub fn check_dir(
    dir: &Path,
    name: &str,
    files: &[ModelFile],
    size: u64,
    sha256: &str,
    free: u64,
) -> Result<(), ModelError> {
    let total = check_files(files).map_err(ModelError::BadManifest)?;
    if total != size {
        return Err(ModelError::Mismatch(format!(
            "the files add up to {total} bytes, {size} announced"
        )));
    }
    check(dir, name, size, sha256, free)
}

/// The data frames of a push as one byte stream: ends at the empty frame; a transfer that
/// breaks off before it is an error.
struct FrameStream<'a, R: Read> {
    r: &'a mut R,
    piece: Vec<u8>,
    at: usize,
    ended: bool,
}

impl<R: Read> Read for FrameStream<'_, R> {
    fn read(&mut self, out: &mut [u8]) -> io::Result<usize> {
        while self.at == self.piece.len() {
            if self.ended {
                return Ok(0);
            }
            self.piece = read_frame(self.r)
                .map_err(|e| io::Error::other(ModelError::Transfer(e)))?
                .to_vec();
            self.at = 0;
            self.ended = self.piece.is_empty();
        }
        let n = out.len().min(self.piece.len() - self.at);
        out[..n].copy_from_slice(&self.piece[self.at..self.at + n]);
        self.at += n;
        Ok(n)
    }
}

/// Writes what it is given to a file and to two hashers (the file's, the stream's).
struct Hashing<'a> {
    file: File,
    own: Sha256,
    all: &'a mut Sha256,
}

impl Write for Hashing<'_> {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        let n = self.file.write(buf)?;
        self.own.update(&buf[..n]);
        self.all.update(&buf[..n]);
        Ok(n)
    }

    fn flush(&mut self) -> io::Result<()> {
        self.file.flush()
    }
}

fn io_error(e: io::Error, size: u64) -> ModelError {
    if e.raw_os_error() == Some(libc::ENOSPC) {
        return ModelError::NoSpace {
            need: size,
            free: 0,
        };
    }
    // A transfer error the frame stream carried through io::copy.
    if e.get_ref().is_some_and(|i| i.is::<ModelError>()) {
        if let Some(Ok(m)) = e.into_inner().map(|i| i.downcast::<ModelError>()) {
            return *m;
        }
        return ModelError::Io(io::Error::other("a transfer error"));
    }
    ModelError::Io(e)
}

/// Reads a directory push's data frames (the files' bytes in `files`' order, an empty
/// frame at the end) into `<dir>/.NAME.partial/`, each file checked against its size and
/// SHA-256 and the whole stream against `sha256`, then puts the directory in place as
/// `<dir>/NAME` atomically (exchanged with what was there, which is then removed). On any
/// failure the partial directory is removed and what was there stays. Returns the bytes
/// stored and the stream's SHA-256.
pub fn receive_dir(
    dir: &Path,
    name: &str,
    files: &[ModelFile],
    sha256: &str,
    r: &mut impl Read,
) -> Result<(u64, String), ModelError> {
    let tmp = partial(dir, name);
    let result = write_partial_dir(&tmp, files, sha256, r).and_then(|stored| {
        put_in_place(dir, &tmp, &dir.join(name))?;
        Ok(stored)
    });
    if result.is_err() {
        remove_any(&tmp);
    }
    result
}

fn remove_any(path: &Path) {
    match fs::symlink_metadata(path) {
        Ok(m) if m.is_dir() => {
            let _ = fs::remove_dir_all(path);
        }
        Ok(_) => {
            let _ = fs::remove_file(path);
        }
        Err(_) => {}
    }
}

fn write_partial_dir(
    tmp: &Path,
    files: &[ModelFile],
    sha256: &str,
    r: &mut impl Read,
) -> Result<(u64, String), ModelError> {
    remove_any(tmp);
    fs::create_dir(tmp)?;
    let total: u64 = files.iter().map(|f| f.size).sum();
    let mut stream = FrameStream {
        r,
        piece: Vec::new(),
        at: 0,
        ended: false,
    };
    let mut all = Sha256::new();
    let mut written = 0u64;
    for f in files {
        // check_files refused every path that could leave `tmp`.
        let path = tmp.join(&f.path);
        if let Some(parent) = path.parent() {
            fs::create_dir_all(parent)?;
        }
        let file = OpenOptions::new()
            .write(true)
            .create_new(true)
            .open(&path)?;
        let mut out = Hashing {
            file,
            own: Sha256::new(),
            all: &mut all,
        };
        let n =
            io::copy(&mut (&mut stream).take(f.size), &mut out).map_err(|e| io_error(e, total))?;
        written += n;
        if n != f.size {
            return Err(ModelError::Mismatch(format!(
                "{:?}: {n} bytes, {} announced (the stream ended early)",
                f.path, f.size
            )));
        }
        let got = hex::encode(out.own.finalize_reset());
        if got != f.sha256 {
            return Err(ModelError::Mismatch(format!(
                "{:?}: SHA-256 {got}, {} announced",
                f.path, f.sha256
            )));
        }
        out.file.sync_all()?;
    }
    let mut extra = [0u8; 1];
    if stream.read(&mut extra).map_err(|e| io_error(e, total))? != 0 {
        return Err(ModelError::Mismatch(format!(
            "more than the announced {total} bytes"
        )));
    }
    let got = hex::encode(all.finalize());
    if got != sha256 {
        return Err(ModelError::Mismatch(format!(
            "the stream's SHA-256 {got}, {sha256} announced"
        )));
    }
    sync_dirs(tmp)?;
    Ok((written, got))
}

/// fsyncs `dir` and every directory under it.
fn sync_dirs(dir: &Path) -> io::Result<()> {
    for e in fs::read_dir(dir)? {
        let e = e?;
        if e.file_type()?.is_dir() {
            sync_dirs(&e.path())?;
        }
    }
    File::open(dir)?.sync_all()
}

/// Puts `tmp` at `target` in one step: a plain rename when nothing is there, else an
/// exchange (`renameat2(RENAME_EXCHANGE)`) and the old one removed; then `dir` fsynced.
fn put_in_place(dir: &Path, tmp: &Path, target: &Path) -> io::Result<()> {
    if fs::symlink_metadata(target).is_err() {
        fs::rename(tmp, target)?;
    } else {
        use std::os::unix::ffi::OsStrExt;
        let cstr = |p: &Path| {
            std::ffi::CString::new(p.as_os_str().as_bytes())
                .map_err(|_| io::Error::other("a path with a NUL byte"))
        };
        let (from, to) = (cstr(tmp)?, cstr(target)?);
        // SAFETY: both are valid NUL-terminated paths that outlive the call; renameat2
        // reads nothing else.
        let rc = unsafe {
            libc::renameat2(
                libc::AT_FDCWD,
                from.as_ptr(),
                libc::AT_FDCWD,
                to.as_ptr(),
                libc::RENAME_EXCHANGE,
            )
        };
        if rc != 0 {
            return Err(io::Error::last_os_error());
        }
        // The old model is now at `tmp`.
        remove_any(tmp);
    }
    File::open(dir)?.sync_all()
}

fn entry_bytes(path: &Path) -> u64 {
    match fs::symlink_metadata(path) {
        Ok(m) if m.is_dir() => {
            fs::read_dir(path).map_or(0, |d| d.flatten().map(|e| entry_bytes(&e.path())).sum())
        }
        Ok(m) => m.len(),
        Err(_) => 0,
    }
}

/// The stored models (entries the payload would serve), by name.
pub fn list(dir: &Path) -> Result<Vec<ModelEntry>, ModelError> {
    let entries = match fs::read_dir(dir) {
        Ok(e) => e,
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(Vec::new()),
        Err(e) => return Err(e.into()),
    };
    let mut models: Vec<ModelEntry> = entries
        .flatten()
        .filter_map(|e| {
            let name = e.file_name().into_string().ok()?;
            valid_name(&name).then(|| ModelEntry {
                bytes: entry_bytes(&e.path()),
                name,
            })
        })
        .collect();
    models.sort_by(|a, b| a.name.cmp(&b.name));
    Ok(models)
}

/// Removes a stored model.
pub fn remove(dir: &Path, name: &str) -> Result<(), ModelError> {
    if !valid_name(name) {
        return Err(ModelError::BadName(name.to_string()));
    }
    let path = dir.join(name);
    match fs::symlink_metadata(&path) {
        Ok(m) if m.is_dir() => fs::remove_dir_all(&path)?,
        Ok(_) => fs::remove_file(&path)?,
        Err(e) if e.kind() == io::ErrorKind::NotFound => {
            return Err(ModelError::NotFound(name.to_string()))
        }
        Err(e) => return Err(e.into()),
    }
    File::open(dir)?.sync_all()?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use tenantvm_agent_protocol::encode_data;

    fn frames(data: &[u8], piece: usize, end: bool) -> Vec<u8> {
        let mut out = Vec::new();
        for c in data.chunks(piece) {
            out.extend(encode_data(c).unwrap());
        }
        if end {
            out.extend(encode_data(b"").unwrap());
        }
        out
    }

    fn sha(data: &[u8]) -> String {
        hex::encode(Sha256::digest(data))
    }

    fn visible(dir: &Path) -> Vec<String> {
        let mut v: Vec<String> = fs::read_dir(dir)
            .unwrap()
            .flatten()
            .map(|e| e.file_name().into_string().unwrap())
            .collect();
        v.sort();
        v
    }

    #[test]
    fn a_push_lands_whole_under_its_name_and_lists_and_removes() {
        let dir = tempfile::tempdir().unwrap();
        let models = dir.path().join(MODELS_DIR);
        let data = vec![7u8; 200_000];
        check(&models, "mine", data.len() as u64, &sha(&data), u64::MAX).unwrap();
        let got = receive(
            &models,
            "mine",
            data.len() as u64,
            &sha(&data),
            &mut &frames(&data, 65536, true)[..],
        )
        .unwrap();
        assert_eq!(got, (200_000, sha(&data)));
        assert_eq!(fs::read(models.join("mine")).unwrap(), data);
        assert_eq!(visible(&models), ["mine"]);
        assert_eq!(
            list(&models).unwrap(),
            [ModelEntry {
                name: "mine".into(),
                bytes: 200_000
            }]
        );
        remove(&models, "mine").unwrap();
        assert!(list(&models).unwrap().is_empty());
        assert!(matches!(
            remove(&models, "mine"),
            Err(ModelError::NotFound(_))
        ));
    }

    #[test]
    fn broken_mismatched_or_oversized_pushes_leave_nothing_visible() {
        let dir = tempfile::tempdir().unwrap();
        let models = dir.path().join(MODELS_DIR);
        fs::create_dir_all(&models).unwrap();
        let data = b"the model bytes".to_vec();
        let n = data.len() as u64;
        // Cut off before the end frame.
        let e = receive(
            &models,
            "m",
            n,
            &sha(&data),
            &mut &frames(&data, 4, false)[..],
        )
        .unwrap_err();
        assert!(matches!(e, ModelError::Transfer(_)), "{e}");
        // Wrong hash, short, long.
        let e = receive(
            &models,
            "m",
            n,
            &sha(b"other"),
            &mut &frames(&data, 4, true)[..],
        )
        .unwrap_err();
        assert_eq!(e.code(), ErrorCode::Mismatch);
        let e = receive(
            &models,
            "m",
            n + 1,
            &sha(&data),
            &mut &frames(&data, 4, true)[..],
        )
        .unwrap_err();
        assert_eq!(e.code(), ErrorCode::Mismatch);
        let e = receive(
            &models,
            "m",
            n - 1,
            &sha(&data),
            &mut &frames(&data, 4, true)[..],
        )
        .unwrap_err();
        assert_eq!(e.code(), ErrorCode::Mismatch);
        assert!(visible(&models).is_empty(), "{:?}", visible(&models));
        // A model that is there stays as it was when a new push of it fails.
        receive(
            &models,
            "m",
            n,
            &sha(&data),
            &mut &frames(&data, 4, true)[..],
        )
        .unwrap();
        let e = receive(
            &models,
            "m",
            3,
            &sha(b"abc"),
            &mut &frames(b"abd", 4, true)[..],
        )
        .unwrap_err();
        assert_eq!(e.code(), ErrorCode::Mismatch);
        assert_eq!(fs::read(models.join("m")).unwrap(), data);
        assert_eq!(visible(&models), ["m"]);
    }

    #[test]
    fn bad_names_hashes_and_a_full_disk_are_refused_before_any_data() {
        let dir = tempfile::tempdir().unwrap();
        let ok = sha(b"x");
        for bad in ["", ".hidden", "a/b", "../x", &"x".repeat(65), "sp ace"] {
            assert!(
                matches!(
                    check(dir.path(), bad, 1, &ok, u64::MAX),
                    Err(ModelError::BadName(_))
                ),
                "{bad:?}"
            );
        }
        assert!(matches!(
            check(dir.path(), "m", 1, "ABC", u64::MAX),
            Err(ModelError::BadHash)
        ));
        assert!(matches!(
            check(dir.path(), "m", 1, &ok.to_uppercase(), u64::MAX),
            Err(ModelError::BadHash)
        ));
        let e = check(dir.path(), "m", 10 << 20, &ok, 5 << 20).unwrap_err();
        assert_eq!(e.code(), ErrorCode::NoSpace);
        assert!(e.to_string().contains("disk_gib"), "{e}");
        assert!(free_bytes(dir.path()).unwrap() > 0);
    }

    fn manifest(files: &[(&str, &[u8])]) -> (Vec<ModelFile>, Vec<u8>, String) {
        let list = files
            .iter()
            .map(|(p, d)| ModelFile {
                path: p.to_string(),
                size: d.len() as u64,
                sha256: sha(d),
            })
            .collect();
        let data: Vec<u8> = files.iter().flat_map(|(_, d)| d.to_vec()).collect();
        let all = sha(&data);
        (list, data, all)
    }

    #[test]
    fn a_model_directory_lands_whole_and_replaces_the_old_one_in_one_step() {
        let dir = tempfile::tempdir().unwrap();
        let models = dir.path().join(MODELS_DIR);
        fs::create_dir_all(&models).unwrap();
        // An old single-file model of that name is there.
        fs::write(models.join("hf"), b"old").unwrap();
        let shard = vec![3u8; 150_000];
        let (files, data, all) = manifest(&[
            ("config.json", b"{}"),
            ("tokenizer.json", b"{\"v\":1}"),
            ("model-00001-of-00001.safetensors", &shard),
            ("1_Pooling/config.json", b"{\"p\":2}"),
        ]);
        let size = data.len() as u64;
        check_dir(&models, "hf", &files, size, &all, u64::MAX).unwrap();
        // Frames of 7 bytes: files span frames and frames span files.
        let got = receive_dir(
            &models,
            "hf",
            &files,
            &all,
            &mut &frames(&data, 7, true)[..],
        )
        .unwrap();
        assert_eq!(got, (size, all));
        assert_eq!(visible(&models), ["hf"]);
        assert_eq!(fs::read(models.join("hf/config.json")).unwrap(), b"{}");
        assert_eq!(
            fs::read(models.join("hf/model-00001-of-00001.safetensors")).unwrap(),
            shard
        );
        assert_eq!(
            fs::read(models.join("hf/1_Pooling/config.json")).unwrap(),
            b"{\"p\":2}"
        );
        assert_eq!(list(&models).unwrap()[0].bytes, size);
        // A second push of that name replaces the directory whole.
        let (files, data, all) = manifest(&[("config.json", b"{\"new\":true}")]);
        receive_dir(
            &models,
            "hf",
            &files,
            &all,
            &mut &frames(&data, 4, true)[..],
        )
        .unwrap();
        assert_eq!(visible(&models), ["hf"]);
        assert!(!models.join("hf/tokenizer.json").exists());
    }

    #[test]
    fn a_directory_that_breaks_off_mismatches_or_overflows_leaves_the_old_one() {
        let dir = tempfile::tempdir().unwrap();
        let models = dir.path().join(MODELS_DIR);
        fs::create_dir_all(&models).unwrap();
        let (files, data, all) = manifest(&[("a.json", b"first"), ("b.bin", b"second")]);
        receive_dir(&models, "m", &files, &all, &mut &frames(&data, 3, true)[..]).unwrap();
        let (files2, data2, all2) = manifest(&[("a.json", b"FIRST"), ("b.bin", b"SECOND")]);
        // Cut off; a file's bytes not its hash; more than announced; the stream's hash.
        let mut bad_file = files2.clone();
        bad_file[1].sha256 = sha(b"other");
        let mut long = data2.clone();
        long.push(b'!');
        let cases: [(&[ModelFile], Vec<u8>, &str, ErrorCode); 4] = [
            (
                &files2,
                frames(&data2, 3, false),
                &all2,
                ErrorCode::Internal,
            ),
            (
                &bad_file,
                frames(&data2, 3, true),
                &all2,
                ErrorCode::Mismatch,
            ),
            (&files2, frames(&long, 3, true), &all2, ErrorCode::Mismatch),
            (
                &files2,
                frames(&data2, 3, true),
                &sha(b"x"),
                ErrorCode::Mismatch,
            ),
        ];
        for (f, stream, hash, code) in cases {
            let e = receive_dir(&models, "m", f, hash, &mut &stream[..]).unwrap_err();
            assert_eq!(e.code(), code, "{e}");
            assert_eq!(visible(&models), ["m"]);
            assert_eq!(fs::read(models.join("m/a.json")).unwrap(), b"first");
        }
        // A transfer cut off is said as such.
        let e = receive_dir(
            &models,
            "m",
            &files2,
            &all2,
            &mut &frames(&data2, 3, false)[..],
        )
        .unwrap_err();
        assert!(matches!(e, ModelError::Transfer(_)), "{e}");
    }

    #[test]
    fn a_directory_with_an_escaping_path_or_past_the_free_space_is_refused_before_data() {
        let dir = tempfile::tempdir().unwrap();
        let (mut files, data, all) = manifest(&[("config.json", b"{}")]);
        let size = data.len() as u64;
        for bad in ["../etc/shadow", "/abs", "a/../../b"] {
            files[0].path = bad.into();
            let e = check_dir(dir.path(), "m", &files, size, &all, u64::MAX).unwrap_err();
            assert_eq!(e.code(), ErrorCode::BadRequest, "{e}");
            assert!(e.to_string().contains("not a path inside"), "{e}");
        }
        files[0].path = "config.json".into();
        let e = check_dir(dir.path(), "m", &files, size + 1, &all, u64::MAX).unwrap_err();
        assert_eq!(e.code(), ErrorCode::Mismatch);
        // An oversized shard: refused for room before a byte is asked for.
        let big = ModelFile {
            path: "model.gguf".into(),
            size: 10 << 30,
            sha256: all.clone(),
        };
        let e = check_dir(dir.path(), "m", &[big], 10 << 30, &all, 1 << 30).unwrap_err();
        assert_eq!(e.code(), ErrorCode::NoSpace, "{e}");
        assert!(!dir.path().join(".m.partial").exists());
    }
}
