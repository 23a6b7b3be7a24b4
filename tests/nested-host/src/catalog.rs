//! The scenarios: shell scripts in `tests/nested-host/scenarios/`, each described by its
//! header comments:
//!
//! ```text
//! #!/bin/sh
//! # description: what it proves (continuation lines start with "#   ")
//! # limit: 300          seconds before run-scenarios.sh kills it (default 300)
//! # sets: ci            the named sets it belongs to (ci: the test command runs it)
//! # needs: qemu         extra files for the outer root: `qemu`, `llama` (the llama.cpp
//!                       engine's image set and test model) or absolute paths
//! ```
//!
//! Adding a scenario is dropping a script there; `needs` names anything the outer root does
//! not already hold.

use std::path::{Path, PathBuf};

/// The needs build-rootfs.sh knows by name (anything else is an absolute path).
pub const NAMED_NEEDS: [&str; 2] = ["qemu", "llama"];

/// The time limit of a scenario without a `# limit:` line, in seconds.
pub const DEFAULT_LIMIT_S: u64 = 300;

/// Why the scenarios cannot be listed or chosen.
#[derive(Debug, thiserror::Error)]
pub enum CatalogError {
    /// The scenarios folder cannot be read.
    #[error("Cannot read the scenarios in {dir}: {source}")]
    Read {
        /// The folder.
        dir: PathBuf,
        /// The I/O error.
        source: std::io::Error,
    },
    /// A header line is malformed.
    #[error("{path}: {problem}")]
    Header {
        /// The script.
        path: PathBuf,
        /// What is wrong.
        problem: String,
    },
    /// A scenario asked for is not there.
    #[error("Unknown scenario {name:?}; the scenarios are: {}", known.join(", "))]
    Unknown {
        /// The name asked for.
        name: String,
        /// The names there are.
        known: Vec<String>,
    },
    /// A set asked for has no scenarios.
    #[error("No scenario is in set {set:?}; the sets are: {}", known.join(", "))]
    UnknownSet {
        /// The set asked for.
        set: String,
        /// The sets there are.
        known: Vec<String>,
    },
}

/// One scenario script and its header.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Scenario {
    /// The file name without `.sh`.
    pub name: String,
    /// The script.
    pub path: PathBuf,
    /// What it proves.
    pub description: String,
    /// Seconds before it is killed.
    pub limit_s: u64,
    /// The sets it belongs to.
    pub sets: Vec<String>,
    /// Extra files for the outer root.
    pub needs: Vec<String>,
}

impl Scenario {
    /// Parses the header of the script `path` (its text is `text`).
    pub fn parse(path: &Path, text: &str) -> Result<Self, CatalogError> {
        let name = path
            .file_stem()
            .and_then(|s| s.to_str())
            .unwrap_or_default()
            .to_string();
        let bad = |problem: String| CatalogError::Header {
            path: path.to_path_buf(),
            problem,
        };
        if name.is_empty()
            || !name
                .chars()
                .all(|c| c.is_ascii_alphanumeric() || c == '-' || c == '_')
        {
            return Err(bad(format!(
                "scenario names are letters, digits, '-' and '_' (got {name:?})"
            )));
        }
        let mut scenario = Scenario {
            name,
            path: path.to_path_buf(),
            description: String::new(),
            limit_s: DEFAULT_LIMIT_S,
            sets: Vec::new(),
            needs: Vec::new(),
        };
        let mut in_description = false;
        for line in text.lines().skip_while(|l| l.starts_with("#!")) {
            let Some(comment) = line.strip_prefix('#') else {
                break;
            };
            if in_description {
                if let Some(more) = comment.strip_prefix("   ") {
                    scenario.description.push(' ');
                    scenario.description.push_str(more.trim());
                    continue;
                }
                in_description = false;
            }
            let Some((key, value)) = comment.trim().split_once(':') else {
                continue;
            };
            let value = value.trim();
            match key {
                "description" => {
                    scenario.description = value.to_string();
                    in_description = true;
                }
                "limit" => {
                    scenario.limit_s = value
                        .parse()
                        .ok()
                        .filter(|s| *s > 0)
                        .ok_or_else(|| bad(format!("limit must be seconds, got {value:?}")))?;
                }
                "sets" => scenario.sets = words(value),
                "needs" => {
                    scenario.needs = words(value);
                    if let Some(n) = scenario
                        .needs
                        .iter()
                        .find(|n| !NAMED_NEEDS.contains(&n.as_str()) && !n.starts_with('/'))
                    {
                        return Err(bad(format!(
                            "needs takes `qemu`, `llama` or absolute paths, got {n:?}"
                        )));
                    }
                }
                _ => {}
            }
        }
        Ok(scenario)
    }
}

fn words(s: &str) -> Vec<String> {
    s.split([' ', ','])
        .filter(|w| !w.is_empty())
        .map(str::to_string)
        .collect()
}

/// All scenarios of a folder, sorted by name.
#[derive(Clone, Debug)]
pub struct Catalog {
    scenarios: Vec<Scenario>,
}

impl Catalog {
    /// Reads every `*.sh` in `dir`.
    pub fn load(dir: &Path) -> Result<Self, CatalogError> {
        let read_err = |source| CatalogError::Read {
            dir: dir.to_path_buf(),
            source,
        };
        let mut scenarios = Vec::new();
        for entry in std::fs::read_dir(dir).map_err(read_err)? {
            let path = entry.map_err(read_err)?.path();
            if path.extension().is_some_and(|e| e == "sh") {
                let text = std::fs::read_to_string(&path).map_err(read_err)?;
                scenarios.push(Scenario::parse(&path, &text)?);
            }
        }
        scenarios.sort_by(|a, b| a.name.cmp(&b.name));
        Ok(Catalog { scenarios })
    }

    /// The repository's scenarios folder.
    pub fn default_dir() -> PathBuf {
        Path::new(env!("CARGO_MANIFEST_DIR")).join("scenarios")
    }

    /// Every scenario.
    pub fn all(&self) -> &[Scenario] {
        &self.scenarios
    }

    /// The scenarios named, in the order given; an unknown name is an error that lists the
    /// known ones. A name may also be `@SET` for every scenario of that set.
    pub fn select(&self, names: &[String]) -> Result<Vec<Scenario>, CatalogError> {
        let mut chosen: Vec<Scenario> = Vec::new();
        for name in names {
            let found: Vec<Scenario> = if let Some(set) = name.strip_prefix('@') {
                self.set(set)?
            } else {
                let s = self
                    .scenarios
                    .iter()
                    .find(|s| &s.name == name)
                    .ok_or_else(|| CatalogError::Unknown {
                        name: name.clone(),
                        known: self.scenarios.iter().map(|s| s.name.clone()).collect(),
                    })?;
                vec![s.clone()]
            };
            for s in found {
                if !chosen.iter().any(|c| c.name == s.name) {
                    chosen.push(s);
                }
            }
        }
        Ok(chosen)
    }

    /// The scenarios of set `set`, by name.
    pub fn set(&self, set: &str) -> Result<Vec<Scenario>, CatalogError> {
        let found: Vec<Scenario> = self
            .scenarios
            .iter()
            .filter(|s| s.sets.iter().any(|x| x == set))
            .cloned()
            .collect();
        if found.is_empty() {
            let mut known: Vec<String> =
                self.scenarios.iter().flat_map(|s| s.sets.clone()).collect();
            known.sort();
            known.dedup();
            return Err(CatalogError::UnknownSet {
                set: set.to_string(),
                known,
            });
        }
        Ok(found)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_header_gives_description_limit_sets_and_needs() {
        let text = "#!/bin/sh\n# description: boots the kernel\n#   twice over\n# limit: 120\n\
                    # sets: ci, bench\n# needs: qemu llama /opt/x\n. \"$NH_LIB\"\n# limit: 5\n";
        let s = Scenario::parse(Path::new("/s/stock-kernel.sh"), text).unwrap();
        assert_eq!(s.name, "stock-kernel");
        assert_eq!(s.description, "boots the kernel twice over");
        assert_eq!(s.limit_s, 120, "only the header counts");
        assert_eq!(s.sets, ["ci", "bench"]);
        assert_eq!(s.needs, ["qemu", "llama", "/opt/x"]);
    }

    #[test]
    fn defaults_and_malformed_headers() {
        let s = Scenario::parse(Path::new("/s/a.sh"), "#!/bin/sh\necho\n").unwrap();
        assert_eq!((s.limit_s, s.sets.len()), (DEFAULT_LIMIT_S, 0));
        for bad in [
            "# limit: soon\n",
            "# limit: 0\n",
            "# needs: relative/path\n",
        ] {
            assert!(Scenario::parse(Path::new("/s/a.sh"), bad).is_err(), "{bad}");
        }
        Scenario::parse(Path::new("/s/a b.sh"), "").unwrap_err();
    }

    #[test]
    fn unknown_names_list_the_known_ones_and_sets_expand() {
        let dir = tempfile::tempdir().unwrap();
        for (name, sets) in [("b", "ci"), ("a", "ci bench"), ("c", "selftest")] {
            std::fs::write(
                dir.path().join(format!("{name}.sh")),
                format!("# sets: {sets}\n"),
            )
            .unwrap();
        }
        std::fs::write(dir.path().join("README"), "not a scenario").unwrap();
        let catalog = Catalog::load(dir.path()).unwrap();
        let names = |v: Vec<Scenario>| v.into_iter().map(|s| s.name).collect::<Vec<_>>();
        assert_eq!(names(catalog.all().to_vec()), ["a", "b", "c"]);
        assert_eq!(
            names(
                catalog
                    .select(&["c".into(), "@ci".into(), "a".into()])
                    .unwrap()
            ),
            ["c", "a", "b"]
        );
        let err = catalog.select(&["nope".into()]).unwrap_err().to_string();
        assert_eq!(err, "Unknown scenario \"nope\"; the scenarios are: a, b, c");
        let err = catalog.select(&["@x".into()]).unwrap_err().to_string();
        assert_eq!(
            err,
            "No scenario is in set \"x\"; the sets are: bench, ci, selftest"
        );
    }

    #[test]
    fn the_repository_scenarios_parse_and_the_ci_set_exists() {
        let catalog = Catalog::load(&Catalog::default_dir()).unwrap();
        assert!(!catalog.set("ci").unwrap().is_empty());
        for s in catalog.all() {
            assert!(!s.description.is_empty(), "{} has no description", s.name);
        }
    }
}
