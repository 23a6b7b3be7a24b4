//! The built inputs of a run: the `KEY=VALUE` file tests/nested-host/prepare.sh writes
//! (target/nested-host/PROFILE/inputs), naming the binaries, the guest image, the test
//! guests and the list of the VMM's KVM test binaries.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

/// The keys of the inputs file, all required.
pub const KEYS: [&str; 5] = [
    "NH_BIN",
    "NH_GUEST_TOOLS",
    "NH_GUEST_IMAGE",
    "NH_TEST_GUESTS",
    "NH_KVM_TESTS_LIST",
];

/// Keys the inputs file may hold: the llama.cpp engine's image set and test model
/// (guest-image/variants/llama-cpp/prepare.sh), for the scenarios that need `llama`; they
/// skip where these are absent.
pub const OPTIONAL_KEYS: [&str; 2] = ["NH_LLAMA_IMAGE", "NH_LLAMA_MODEL"];

/// What the command that makes the inputs is, for error messages.
pub const PREPARE: &str = "scripts/nested-host.sh (or tests/nested-host/prepare.sh)";

/// Why the inputs cannot be used.
#[derive(Debug, thiserror::Error)]
pub enum InputsError {
    /// The file is missing or unreadable.
    #[error(
        "The nested host's inputs {path} cannot be read ({source}): run {PREPARE} to build them"
    )]
    Read {
        /// The file.
        path: PathBuf,
        /// The I/O error.
        source: std::io::Error,
    },
    /// A key is missing.
    #[error("The nested host's inputs {path} do not name {key}: run {PREPARE} again")]
    Missing {
        /// The file.
        path: PathBuf,
        /// The key.
        key: &'static str,
    },
    /// cargo built a newer binary of a listed test since the list was made.
    #[error("The nested host's inputs are stale: {newer} is newer than the listed {listed}; run {PREPARE} again")]
    Stale {
        /// The binary in the list.
        listed: PathBuf,
        /// The newer build of the same test.
        newer: PathBuf,
    },
    /// A file the inputs name is not there.
    #[error("{what} {path} is missing: run {fix}")]
    Absent {
        /// What it is.
        what: &'static str,
        /// Where it should be.
        path: PathBuf,
        /// The command that makes it.
        fix: &'static str,
    },
}

/// The parsed inputs file.
#[derive(Clone, Debug)]
pub struct Inputs {
    /// The file they came from.
    pub path: PathBuf,
    /// Its variables.
    pub vars: BTreeMap<String, String>,
}

impl Inputs {
    /// The inputs file of a build profile (`debug` or `release`) in this repository.
    pub fn default_path(profile: &str) -> PathBuf {
        crate::repo_root()
            .join("target/nested-host")
            .join(profile)
            .join("inputs")
    }

    /// Reads and checks `path`: every key present, and the files they name there.
    pub fn load(path: &Path) -> Result<Self, InputsError> {
        let text = std::fs::read_to_string(path).map_err(|source| InputsError::Read {
            path: path.to_path_buf(),
            source,
        })?;
        let vars: BTreeMap<String, String> = text
            .lines()
            .filter_map(|l| l.split_once('='))
            .map(|(k, v)| (k.trim().to_string(), v.trim().to_string()))
            .collect();
        for key in KEYS {
            if vars.get(key).is_none_or(|v| v.is_empty()) {
                return Err(InputsError::Missing {
                    path: path.to_path_buf(),
                    key,
                });
            }
        }
        let inputs = Inputs {
            path: path.to_path_buf(),
            vars,
        };
        inputs.check()?;
        Ok(inputs)
    }

    /// The value of a key (present after [`Inputs::load`]).
    pub fn get(&self, key: &str) -> &str {
        self.vars.get(key).map_or("", String::as_str)
    }

    fn check(&self) -> Result<(), InputsError> {
        let bin = Path::new(self.get("NH_BIN"));
        let absent = |what, path: PathBuf, fix| {
            if path.exists() {
                Ok(())
            } else {
                Err(InputsError::Absent { what, path, fix })
            }
        };
        for name in [
            "tenantvm-vmm",
            "nh-stock-kernel",
            "nh-guest-image",
            "nh-vfio-kernel",
        ] {
            absent("The binary", bin.join(name), PREPARE)?;
        }
        absent(
            "The guest tool",
            Path::new(self.get("NH_GUEST_TOOLS")).join("nh-vsock-echo"),
            PREPARE,
        )?;
        absent(
            "The guest image",
            Path::new(self.get("NH_GUEST_IMAGE")).join("manifest.json"),
            "guest-image/build.sh",
        )?;
        absent(
            "The test guest",
            Path::new(self.get("NH_TEST_GUESTS")).join("tvm-testguest"),
            "scripts/build-test-guests.sh",
        )?;
        let list = PathBuf::from(self.get("NH_KVM_TESTS_LIST"));
        absent(
            "The list of the VMM's KVM test binaries",
            list.clone(),
            PREPARE,
        )?;
        let text = std::fs::read_to_string(&list).unwrap_or_default();
        for listed in text.lines().filter(|l| !l.is_empty()).map(PathBuf::from) {
            absent("The KVM test binary", listed.clone(), PREPARE)?;
            if let Some(newer) = newer_build(&listed) {
                return Err(InputsError::Stale { listed, newer });
            }
        }
        Ok(())
    }
}

/// A newer build of the same test as `listed` (`deps/NAME-HASH`): cargo names a rebuild
/// with changed dependencies with another hash, leaving the listed one behind.
fn newer_build(listed: &Path) -> Option<PathBuf> {
    let name = listed.file_name()?.to_str()?;
    let stem = &name[..name.rfind('-')? + 1];
    let mtime = |p: &Path| std::fs::metadata(p).and_then(|m| m.modified()).ok();
    let listed_time = mtime(listed)?;
    std::fs::read_dir(listed.parent()?)
        .ok()?
        .flatten()
        .map(|e| e.path())
        .filter(|p| {
            p.file_name()
                .and_then(|n| n.to_str())
                .is_some_and(|n| n.starts_with(stem) && !n.contains('.') && n != name)
        })
        .find(|p| mtime(p).is_some_and(|t| t > listed_time))
}

/// The stock kernel directory: `$TENANTVM_KERNEL_DIR` or .cache/kernel (scripts/setup.sh).
pub fn kernel_dir() -> PathBuf {
    std::env::var_os("TENANTVM_KERNEL_DIR")
        .map_or_else(|| crate::repo_root().join(".cache/kernel"), PathBuf::from)
}

/// Checks the stock kernel and its modules are there.
pub fn check_kernel(dir: &Path) -> Result<(), InputsError> {
    for (what, file) in [
        ("The stock kernel", "vmlinuz"),
        ("The stock kernel's ELF image", "vmlinux"),
        ("The stock kernel's modules", "modules/modules.builtin"),
    ] {
        let path = dir.join(file);
        if !path.exists() {
            return Err(InputsError::Absent {
                what,
                path,
                fix: "scripts/setup.sh",
            });
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn missing_inputs_name_the_command_that_makes_them() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("inputs");
        let err = Inputs::load(&path).unwrap_err().to_string();
        assert!(err.contains("run scripts/nested-host.sh"), "{err}");

        std::fs::write(&path, "NH_BIN=/x\n").unwrap();
        let err = Inputs::load(&path).unwrap_err().to_string();
        assert!(err.contains("do not name NH_GUEST_TOOLS"), "{err}");

        let bin = dir.path().join("bin");
        std::fs::create_dir(&bin).unwrap();
        for name in [
            "tenantvm-vmm",
            "nh-stock-kernel",
            "nh-guest-image",
            "nh-vfio-kernel",
            "nh-vsock-echo",
        ] {
            std::fs::write(bin.join(name), "").unwrap();
        }
        let b = bin.display();
        let img = dir.path().join("image");
        std::fs::write(
            &path,
            format!("NH_BIN={b}\nNH_GUEST_TOOLS={b}\nNH_GUEST_IMAGE={}\nNH_TEST_GUESTS={b}\nNH_KVM_TESTS_LIST={b}/list\n", img.display()),
        )
        .unwrap();
        let err = Inputs::load(&path).unwrap_err().to_string();
        assert!(
            err.contains("guest image") && err.contains("run guest-image/build.sh"),
            "{err}"
        );
    }

    #[test]
    fn a_newer_build_of_a_listed_test_makes_the_inputs_stale() {
        let dir = tempfile::tempdir().unwrap();
        let old = dir.path().join("guest_smp-aaaa");
        std::fs::write(&old, "").unwrap();
        std::fs::write(dir.path().join("guest_smp-aaaa.d"), "").unwrap();
        std::fs::write(dir.path().join("guest_smpx-cccc"), "").unwrap();
        assert_eq!(newer_build(&old), None);
        let past = std::time::SystemTime::now() - std::time::Duration::from_secs(60);
        std::fs::File::options()
            .write(true)
            .open(&old)
            .unwrap()
            .set_modified(past)
            .unwrap();
        let new = dir.path().join("guest_smp-bbbb");
        std::fs::write(&new, "").unwrap();
        assert_eq!(newer_build(&old), Some(new));
    }

    #[test]
    fn a_missing_kernel_names_setup() {
        let dir = tempfile::tempdir().unwrap();
        let err = check_kernel(dir.path()).unwrap_err().to_string();
        assert!(
            err.contains("vmlinuz is missing: run scripts/setup.sh"),
            "{err}"
        );
    }
}
