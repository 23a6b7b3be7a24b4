//! The cap on the VMM's exit-report directory. The directory is writable by the jailed VMM
//! (it writes `exit.json.tmp` and renames it to `exit.json`), so a compromised VMM could
//! fill it with files until the host file system runs out of inodes, and every later pass
//! over it would take longer. The daemon caps it whenever it looks at it: at each status
//! query of the running VM, before it reads the exit report, and at each launch (which
//! empties it). Entries beyond [`MAX_REPORT_ENTRIES`] are removed oldest first (by
//! modification time, then name), so the newest, the exit report an honest VMM just wrote
//! among them, stay. One pass holds at most the cap's worth of entries in memory, however
//! many the directory holds.

use std::cmp::Reverse;
use std::collections::BinaryHeap;
use std::ffi::OsString;
use std::fs;
use std::path::{Path, PathBuf};
use std::time::SystemTime;

/// The most entries the report directory keeps (an honest VMM leaves one or two).
pub const MAX_REPORT_ENTRIES: usize = 8;

/// Why the report directory could not be capped.
#[derive(Debug, thiserror::Error)]
pub enum ReportDirError {
    /// Listing the directory failed.
    #[error("cannot list the VMM's report directory {path}: {source}")]
    List {
        /// The directory.
        path: PathBuf,
        /// The cause.
        #[source]
        source: std::io::Error,
    },
    /// Removing an entry beyond the cap failed.
    #[error("cannot remove {path} from the VMM's report directory (over its cap of {cap} entries): {source}")]
    Remove {
        /// The entry.
        path: PathBuf,
        /// The cap.
        cap: usize,
        /// The cause.
        #[source]
        source: std::io::Error,
    },
}

/// Removes the oldest entries of `dir` beyond `cap` (files, links, and directories with
/// what they hold; links are removed, never followed). Returns how many it removed; a
/// missing directory has none.
pub fn cap_entries(dir: &Path, cap: usize) -> Result<usize, ReportDirError> {
    let list = |source| ReportDirError::List {
        path: dir.to_path_buf(),
        source,
    };
    let entries = match fs::read_dir(dir) {
        Ok(entries) => entries,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(0),
        Err(source) => return Err(list(source)),
    };
    // The newest `cap` entries seen so far, oldest on top; whatever falls out is removed
    // at once, so memory stays at the cap.
    let mut kept: BinaryHeap<Reverse<(SystemTime, OsString)>> = BinaryHeap::new();
    let mut removed = 0;
    for entry in entries {
        let entry = entry.map_err(list)?;
        // An entry removed since the listing began is no longer there to count.
        let Ok(meta) = fs::symlink_metadata(entry.path()) else {
            continue;
        };
        let when = meta.modified().unwrap_or(SystemTime::UNIX_EPOCH);
        kept.push(Reverse((when, entry.file_name())));
        if kept.len() > cap {
            let Some(Reverse((_, name))) = kept.pop() else {
                continue;
            };
            remove(&dir.join(name), cap)?;
            removed += 1;
        }
    }
    Ok(removed)
}

fn remove(path: &Path, cap: usize) -> Result<(), ReportDirError> {
    let result = match fs::symlink_metadata(path) {
        Ok(meta) if meta.is_dir() => fs::remove_dir_all(path),
        Ok(_) => fs::remove_file(path),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
        Err(e) => Err(e),
    };
    match result {
        Ok(()) => Ok(()),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
        Err(source) => Err(ReportDirError::Remove {
            path: path.to_path_buf(),
            cap,
            source,
        }),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    /// A file modified `ahead_s` seconds from now (ahead of everything made plainly).
    fn touch(dir: &Path, name: &str, ahead_s: u64) {
        let path = dir.join(name);
        fs::write(&path, name).unwrap();
        let when = SystemTime::now() + Duration::from_secs(ahead_s);
        fs::File::options()
            .write(true)
            .open(&path)
            .unwrap()
            .set_modified(when)
            .unwrap();
    }

    fn names(dir: &Path) -> Vec<String> {
        let mut v: Vec<String> = fs::read_dir(dir)
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .collect();
        v.sort();
        v
    }

    #[test]
    fn entries_beyond_the_cap_go_oldest_first_and_the_newest_report_stays() {
        let tmp = tempfile::tempdir().unwrap();
        let dir = tmp.path();
        // A directory and a link to something outside, the oldest entries: removed, the
        // outside untouched.
        fs::create_dir_all(dir.join("old-dir/inner")).unwrap();
        fs::write(dir.join("old-dir/inner/f"), "x").unwrap();
        let elsewhere = tempfile::tempdir().unwrap();
        let outside = elsewhere.path().join("outside");
        fs::write(&outside, "keep").unwrap();
        std::os::unix::fs::symlink(&outside, dir.join("link")).unwrap();
        for i in 0..20u64 {
            // junk-00 is the oldest, junk-19 the newest of the junk.
            touch(dir, &format!("junk-{i:02}"), 100 + i);
        }
        touch(dir, "exit.json", 1000);
        let removed = cap_entries(dir, 4).unwrap();
        assert_eq!(removed, 23 - 4);
        assert_eq!(
            names(dir),
            ["exit.json", "junk-17", "junk-18", "junk-19"],
            "the newest stay"
        );
        assert_eq!(fs::read_to_string(&outside).unwrap(), "keep");
        // Under the cap nothing changes; a missing directory has nothing to remove.
        assert_eq!(cap_entries(dir, 4).unwrap(), 0);
        assert_eq!(names(dir).len(), 4);
        assert_eq!(cap_entries(&dir.join("missing"), 4).unwrap(), 0);
    }

    #[test]
    fn a_directory_that_cannot_be_listed_is_a_clear_error() {
        let tmp = tempfile::tempdir().unwrap();
        let file = tmp.path().join("not-a-dir");
        fs::write(&file, "x").unwrap();
        let err = cap_entries(&file, 4).unwrap_err().to_string();
        assert!(
            err.contains("cannot list the VMM's report directory"),
            "{err}"
        );
    }
}
