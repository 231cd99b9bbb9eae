//! The config file's layer: each key read as its row says. Relative paths in a file are relative
//! to that file's directory, so a config works from wherever the gateway is started.

use std::path::{Path, PathBuf};

use super::model::ConfigError;
use super::parts::rows;
use super::setting::{Kind, Layer, Origin, Value};

/// Reads and parses `path` into a layer; a key no row declares is refused, named in full.
pub fn read(path: &Path) -> Result<Layer, ConfigError> {
    let text = std::fs::read_to_string(path).map_err(|source| ConfigError::Read {
        path: path.to_owned(),
        source,
    })?;
    let invalid = |message: String| ConfigError::Invalid {
        source_name: path.display().to_string(),
        message,
    };
    let table: toml::Table =
        toml::from_str(&text).map_err(|e| invalid(e.to_string().trim_end().to_owned()))?;
    let reader = Reader {
        path,
        base: path.parent().map(Path::to_owned).unwrap_or_default(),
    };
    let mut layer = Layer::default();
    reader.table(&table, "", &mut layer)?;
    Ok(layer)
}

struct Reader<'a> {
    path: &'a Path,
    base: PathBuf,
}

impl Reader<'_> {
    /// The keys of `table`, whose rows' names start with `prefix` (`ban.` inside `[ban]`).
    fn table(
        &self,
        table: &toml::Table,
        prefix: &str,
        layer: &mut Layer,
    ) -> Result<(), ConfigError> {
        for (key, value) in table {
            let name = format!("{prefix}{key}");
            let inner = format!("{name}.");
            if let toml::Value::Table(t) = value {
                if rows().any(|r| r.name.starts_with(&inner)) {
                    self.table(t, &inner, layer)?;
                    continue;
                }
            }
            let Some(row) = rows().find(|r| r.name == name) else {
                return Err(self.unknown(&name, prefix));
            };
            let value = self
                .value(row.kind, value)
                .map_err(|m| Origin::File(self.path.to_owned()).error(row, m))?;
            layer.set(row.name, value);
        }
        Ok(())
    }

    /// Names the keys this level of the file may hold (`ban` for the `[ban]` table).
    fn unknown(&self, name: &str, prefix: &str) -> ConfigError {
        let mut known: Vec<String> = Vec::new();
        for rest in rows().filter_map(|r| r.name.strip_prefix(prefix)) {
            let key = format!("`{prefix}{}`", rest.split('.').next().unwrap_or(rest));
            if !known.contains(&key) {
                known.push(key);
            }
        }
        ConfigError::Invalid {
            source_name: self.path.display().to_string(),
            message: format!(
                "unknown field `{name}`, expected one of {}",
                known.join(", ")
            ),
        }
    }

    fn value(&self, kind: Kind, value: &toml::Value) -> Result<Value, String> {
        use toml::Value as T;
        let expected = match (kind, value) {
            (Kind::Text | Kind::Choice(_), T::String(s)) => return Ok(Value::Text(s.clone())),
            (Kind::Path, T::String(s)) => return Ok(Value::Path(self.here(s))),
            (Kind::Int, T::Integer(n)) => return whole(*n).map(Value::Int),
            (Kind::Bool, T::Boolean(b)) => return Ok(Value::Bool(*b)),
            (Kind::Texts, T::Array(items)) => return texts(items).map(Value::Texts),
            (Kind::Ints, T::Array(items)) => return ints(items).map(Value::Ints),
            (Kind::Number, T::Integer(n)) => return Ok(Value::Text(n.to_string())),
            (Kind::Number, T::Float(f)) => return Ok(Value::Text(f.to_string())),
            (Kind::Number, T::String(s)) => return Ok(Value::Text(s.clone())),
            (Kind::Number, _) => "a number or a string",
            (Kind::Text | Kind::Choice(_) | Kind::Path, _) => "a string",
            (Kind::Int, _) => "an integer",
            (Kind::Bool, _) => "true or false",
            (Kind::Texts, _) => "an array of strings",
            (Kind::Ints, _) => "an array of integers",
        };
        Err(format!(
            "invalid type: {}, expected {expected}",
            value.type_str()
        ))
    }

    fn here(&self, p: &str) -> PathBuf {
        let p = PathBuf::from(p);
        if p.is_absolute() {
            p
        } else {
            self.base.join(p)
        }
    }
}

fn whole(n: i64) -> Result<u64, String> {
    u64::try_from(n).map_err(|_| format!("invalid value: integer `{n}`, expected u64"))
}

fn texts(items: &[toml::Value]) -> Result<Vec<String>, String> {
    items
        .iter()
        .map(|v| match v {
            toml::Value::String(s) => Ok(s.clone()),
            other => Err(format!(
                "invalid type: {}, expected a string",
                other.type_str()
            )),
        })
        .collect()
}

fn ints(items: &[toml::Value]) -> Result<Vec<u64>, String> {
    items
        .iter()
        .map(|v| match v {
            toml::Value::Integer(n) => whole(*n),
            other => Err(format!(
                "invalid type: {}, expected an integer",
                other.type_str()
            )),
        })
        .collect()
}
