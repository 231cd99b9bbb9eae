//! Plan files: one TOML file per plan in the plans directory, edited by hand. The plan's name is
//! the file's name (`free.toml` is the plan `free`). Every field is checked by hand rather than
//! by a derive, so that an error names the file and the field an operator has to fix.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;

/// A plan's quotas.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Limits {
    pub per_minute: u64,
    pub per_day: u64,
}

#[derive(Debug, thiserror::Error)]
pub enum PlanError {
    #[error("{}: cannot read: {source}", path.display())]
    Read {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("{}: {message}", path.display())]
    Invalid { path: PathBuf, message: String },
    #[error("{}: holds no plan files (*.toml)", dir.display())]
    Empty { dir: PathBuf },
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Plan {
    pub name: Arc<str>,
    pub limits: Limits,
}

#[derive(Debug, Clone, Default)]
pub struct Plans {
    by_name: HashMap<String, Arc<Plan>>,
    /// Files in the directory that are not plan files (an editor's `free.bak.toml`, a
    /// `Free.toml`, a `README.md`): skipped, and named in one warning, never fatal.
    ignored: Vec<PathBuf>,
}

const FIELDS: [&str; 3] = ["requests_per_minute", "requests_per_day", "description"];

impl Plans {
    /// Loads every plan file (`<name>.toml`, the name in a-z, 0-9, `-` and `_`) in `dir`. Other
    /// files are skipped and listed in [`Plans::ignored`]; hidden files silently. A bad plan
    /// file fails the whole load, so a half-applied edit never takes effect.
    pub fn load_dir(dir: &Path) -> Result<Plans, PlanError> {
        let read_err = |source| PlanError::Read {
            path: dir.to_owned(),
            source,
        };
        let mut by_name = HashMap::new();
        let mut ignored = Vec::new();
        for entry in std::fs::read_dir(dir).map_err(read_err)? {
            let path = entry.map_err(read_err)?.path();
            let hidden = path
                .file_name()
                .is_none_or(|f| f.as_encoded_bytes().starts_with(b"."));
            // Only regular files (following a symlink): a FIFO would block the reload and a
            // link to a device would never end.
            let regular = std::fs::metadata(&path).is_ok_and(|m| m.is_file());
            let Some(name) = plan_name(&path).filter(|_| regular) else {
                if !hidden {
                    ignored.push(path);
                }
                continue;
            };
            let invalid = |message: String| PlanError::Invalid {
                path: path.clone(),
                message,
            };
            let text = read_small(&path).map_err(|source| PlanError::Read {
                path: path.clone(),
                source,
            })?;
            let limits = parse_limits(&text).map_err(invalid)?;
            by_name.insert(
                name.to_owned(),
                Arc::new(Plan {
                    name: name.into(),
                    limits,
                }),
            );
        }
        if by_name.is_empty() {
            return Err(PlanError::Empty {
                dir: dir.to_owned(),
            });
        }
        ignored.sort();
        Ok(Plans { by_name, ignored })
    }

    /// What [`Plans::load_dir`] skipped as not a plan file.
    pub fn ignored(&self) -> &[PathBuf] {
        &self.ignored
    }

    /// One line naming the skipped files, when there are any.
    pub fn ignored_warning(&self, dir: &Path) -> Option<String> {
        if self.ignored.is_empty() {
            return None;
        }
        let names: Vec<String> = self
            .ignored
            .iter()
            .map(|p| {
                p.file_name()
                    .unwrap_or_default()
                    .to_string_lossy()
                    .into_owned()
            })
            .collect();
        Some(format!(
            "{}: ignored {} (not plan files: a plan file is named <plan>.toml with the plan in \
             a-z, 0-9, '-' and '_')",
            dir.display(),
            names.join(", ")
        ))
    }

    pub fn get(&self, name: &str) -> Option<&Arc<Plan>> {
        self.by_name.get(name)
    }

    pub fn contains(&self, name: &str) -> bool {
        self.by_name.contains_key(name)
    }

    /// Plan names, sorted.
    pub fn names(&self) -> Vec<&str> {
        let mut names: Vec<&str> = self.by_name.keys().map(String::as_str).collect();
        names.sort_unstable();
        names
    }
}

/// A plan file is a few lines; more than this is not one.
const MAX_PLAN_FILE: u64 = 64 * 1024;

fn read_small(path: &Path) -> std::io::Result<String> {
    use std::io::Read;
    let mut text = String::new();
    std::fs::File::open(path)?
        .take(MAX_PLAN_FILE + 1)
        .read_to_string(&mut text)?;
    if text.len() as u64 > MAX_PLAN_FILE {
        return Err(std::io::Error::other(format!(
            "larger than {MAX_PLAN_FILE} bytes: not a plan file"
        )));
    }
    Ok(text)
}

fn plan_name(path: &Path) -> Option<&str> {
    let file = path.file_name()?.to_str()?;
    let name = file.strip_suffix(".toml")?;
    let valid = !name.is_empty()
        && name
            .bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-' || b == b'_');
    valid.then_some(name)
}

/// Parses one plan file's text; the error says which field is wrong.
pub fn parse_limits(text: &str) -> Result<Limits, String> {
    let table: toml::Table = text
        .parse()
        .map_err(|e: toml::de::Error| format!("not valid TOML: {}", e.to_string().trim_end()))?;
    if let Some(unknown) = table.keys().find(|k| !FIELDS.contains(&k.as_str())) {
        return Err(format!(
            "unknown field `{unknown}`; a plan has {}",
            FIELDS.join(", ")
        ));
    }
    if let Some(d) = table.get("description") {
        if !d.is_str() {
            return Err("field `description` must be a string".into());
        }
    }
    let positive = |field: &str| -> Result<u64, String> {
        match table.get(field) {
            None => Err(format!("field `{field}` is missing")),
            // Counts are kept in 32 bits (the Redis state and the embedded store).
            Some(toml::Value::Integer(n)) if (1..=i64::from(u32::MAX)).contains(n) => Ok(*n as u64),
            Some(v) => Err(format!(
                "field `{field}` must be a whole number of requests from 1 to {} (got {v})",
                u32::MAX
            )),
        }
    };
    Ok(Limits {
        per_minute: positive("requests_per_minute")?,
        per_day: positive("requests_per_day")?,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn write(dir: &Path, name: &str, text: &str) {
        std::fs::write(dir.join(name), text).unwrap();
    }

    #[test]
    fn loads_every_plan_file_and_ignores_other_files() {
        let dir = tempfile::tempdir().unwrap();
        write(
            dir.path(),
            "free.toml",
            "requests_per_minute = 60\nrequests_per_day = 1000\n",
        );
        write(
            dir.path(),
            "acme-corp.toml",
            "description = \"custom\"\nrequests_per_minute = 7\nrequests_per_day = 9\n",
        );
        write(dir.path(), "README.md", "not a plan");
        write(dir.path(), ".free.toml.swp", "junk");
        // An editor's backup and a wrongly cased copy hold junk: skipped, never fatal.
        write(dir.path(), "free.bak.toml", "junk = = 1");
        write(dir.path(), "Free.toml", "requests_per_minute = 0");
        // Not regular files: a FIFO would block a read forever, a directory cannot be read.
        std::fs::create_dir(dir.path().join("dir.toml")).unwrap();
        #[cfg(unix)]
        assert!(std::process::Command::new("mkfifo")
            .arg(dir.path().join("fifo.toml"))
            .status()
            .unwrap()
            .success());
        let plans = Plans::load_dir(dir.path()).unwrap();
        assert_eq!(plans.names(), ["acme-corp", "free"]);
        let ignored: Vec<_> = plans
            .ignored()
            .iter()
            .map(|p| p.file_name().unwrap())
            .collect();
        #[cfg(unix)]
        assert_eq!(
            ignored,
            [
                "Free.toml",
                "README.md",
                "dir.toml",
                "fifo.toml",
                "free.bak.toml"
            ]
        );
        #[cfg(not(unix))]
        assert_eq!(
            ignored,
            ["Free.toml", "README.md", "dir.toml", "free.bak.toml"]
        );
        let warning = plans.ignored_warning(dir.path()).unwrap();
        assert!(
            warning.contains("free.bak.toml") && warning.contains("Free.toml"),
            "{warning}"
        );
        assert_eq!(
            plans.get("free").unwrap().limits,
            Limits {
                per_minute: 60,
                per_day: 1000
            }
        );
    }

    #[test]
    fn errors_name_the_file_and_the_field() {
        let cases = [
            (
                "requests_per_minute = \"60\"\nrequests_per_day = 1",
                "`requests_per_minute`",
            ),
            (
                "requests_per_minute = 0\nrequests_per_day = 1",
                "`requests_per_minute`",
            ),
            ("requests_per_minute = 1", "`requests_per_day`"),
            (
                "requests_per_minute = 1\nrequests_per_day = 4294967296",
                "`requests_per_day`",
            ),
            (
                "requests_per_minute = 1\nrequests_per_day = -4",
                "`requests_per_day`",
            ),
            (
                "requests_per_minute = 1\nrequests_per_day = 4\nburst = 3",
                "`burst`",
            ),
            ("requests_per_minute = = 1", "not valid TOML"),
        ];
        for (text, expected) in cases {
            let dir = tempfile::tempdir().unwrap();
            write(dir.path(), "pro.toml", text);
            let message = Plans::load_dir(dir.path()).unwrap_err().to_string();
            assert!(message.contains("pro.toml"), "{message}");
            assert!(message.contains(expected), "{text:?}: {message}");
        }
    }

    #[test]
    fn an_empty_directory_is_an_error() {
        let dir = tempfile::tempdir().unwrap();
        assert!(matches!(
            Plans::load_dir(dir.path()),
            Err(PlanError::Empty { .. })
        ));
    }
}
