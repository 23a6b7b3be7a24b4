//! The exit report (`--exit-report FILE`): what the VMM ended with and what became of each
//! passed-through device. The temporary file is created before the VM starts (so the
//! seccomp-filtered main thread needs no `open` at the end); the finished report is
//! written to it and renamed into place, so a reader sees the whole report or none.

use std::fs::File;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, PoisonError};

use tenantvm_vmm_api::{DeviceReport, ExitReport};

/// Why the exit report could not be prepared or written.
#[derive(Debug, thiserror::Error)]
pub enum ExitReportError {
    /// The temporary file cannot be created next to the report.
    #[error("Cannot create the exit report {}: {source}; check the directory exists and is writable", path.display())]
    Create {
        /// The temporary file.
        path: PathBuf,
        /// What the OS said.
        source: std::io::Error,
    },
    /// Writing or renaming failed.
    #[error("Cannot write the exit report {}: {source}", path.display())]
    Write {
        /// The report path.
        path: PathBuf,
        /// What the OS said.
        source: std::io::Error,
    },
}

/// An exit report being collected.
pub struct ExitReporter {
    path: PathBuf,
    tmp: PathBuf,
    file: File,
    devices: Arc<Mutex<Vec<DeviceReport>>>,
}

impl ExitReporter {
    /// Creates `<path>.tmp`, to be renamed to `path` by [`ExitReporter::finish`].
    pub fn create(path: &Path) -> Result<Self, ExitReportError> {
        let mut tmp = path.as_os_str().to_owned();
        tmp.push(".tmp");
        let tmp = PathBuf::from(tmp);
        let file = File::create(&tmp).map_err(|source| ExitReportError::Create {
            path: tmp.clone(),
            source,
        })?;
        Ok(Self {
            path: path.to_owned(),
            tmp,
            file,
            devices: Arc::default(),
        })
    }

    /// Where the devices' outcomes are recorded as they happen.
    pub fn devices(&self) -> Arc<Mutex<Vec<DeviceReport>>> {
        self.devices.clone()
    }

    /// Writes the report with exit status `status` and renames it into place.
    pub fn finish(mut self, status: u8) -> Result<(), ExitReportError> {
        let report = ExitReport {
            status,
            devices: self
                .devices
                .lock()
                .unwrap_or_else(PoisonError::into_inner)
                .clone(),
        };
        let err = |source| ExitReportError::Write {
            path: self.path.clone(),
            source,
        };
        let json = serde_json::to_vec_pretty(&report).map_err(|e| err(e.into()))?;
        self.file.write_all(&json).map_err(err)?;
        std::fs::rename(&self.tmp, &self.path).map_err(err)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tenantvm_vmm_api::ResetOutcome;

    #[test]
    fn report_appears_whole_under_its_name() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("exit.json");
        let reporter = ExitReporter::create(&path).unwrap();
        assert!(!path.exists());
        reporter.devices().lock().unwrap().push(DeviceReport {
            path: "model-gpu".into(),
            reset_at_attach: ResetOutcome::Reset {
                method: Some("flr".into()),
            },
            reset_at_detach: ResetOutcome::Unsupported,
            interface: None,
            dma_map_ms: None,
        });
        reporter.finish(6).unwrap();
        let back: ExitReport =
            serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
        assert_eq!(back.status, 6);
        assert_eq!(back.devices[0].reset_at_detach, ResetOutcome::Unsupported);
        assert!(!dir.path().join("exit.json.tmp").exists());
    }

    #[test]
    fn unwritable_directory_is_a_clear_error() {
        let err = ExitReporter::create(Path::new("/nonexistent-dir/exit.json"))
            .err()
            .unwrap();
        assert!(err.to_string().contains("writable"), "{err}");
    }
}
