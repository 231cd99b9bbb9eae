//! The row that declares a setting once, and the merge every row goes through.
//!
//! A row says the setting's file key (its flag and variable follow from it by one rule, so no
//! row can leave a layer out), its default, how its value is checked, and what it means. The file, flag and environment layers, the merge, the
//! book's table and `check`'s report all read the rows, so a setting added as a row is
//! complete everywhere at once.

use std::cell::RefCell;
use std::collections::{BTreeSet, HashMap};
use std::path::PathBuf;
use std::sync::{Mutex, PoisonError};

use clap::builder::PossibleValue;

use crate::config::model::ConfigError;

/// How a value is spelled: what the file must hold, and how a flag or variable is split.
#[derive(Debug, Clone, Copy)]
pub enum Kind {
    Text,
    /// Relative paths in the file are taken from the file's directory.
    Path,
    Int,
    Bool,
    /// An array in the file; repeated or comma-separated as a flag, comma-separated as a variable.
    Texts,
    Ints,
    /// One of fixed names, exact (case-sensitive) in every layer, as clap checks the flag.
    Choice(fn() -> Vec<PossibleValue>),
    /// A number, whole or not, or a word its check knows (`"auto"`): the file may write
    /// either; it reaches the check as text.
    Number,
}

/// A value as a layer gives it, before its setting checks it.
#[derive(Debug, Clone, PartialEq)]
pub enum Value {
    Text(String),
    Path(PathBuf),
    Int(u64),
    Bool(bool),
    Texts(Vec<String>),
    Ints(Vec<u64>),
}

/// The value used when no layer gives one.
#[derive(Debug, Clone, Copy)]
pub enum Preset {
    /// A literal, spelled as in a variable (lists comma-separated, `""` the empty list).
    Value(&'static str),
    /// A value owned by another module, so it is written once, there.
    Of(fn() -> Value),
    /// Worked out from other settings when the part validates; the text says how, for people.
    Computed(&'static str),
    /// No value; the text says what that means.
    Absent(&'static str),
}

/// A setting's flag; `serve` is false for a flag only the `keys` commands take.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Flag {
    /// With its dashes (`--listen`), as errors and help show it.
    pub name: &'static str,
    pub value_name: &'static str,
    pub serve: bool,
}

/// How the flag or the environment spells a setting. By the rule unless a row says otherwise,
/// so a new row is complete in every layer without a line of its own.
#[derive(Debug, Clone, Copy)]
enum Spelling {
    /// From the file key: `ban.strikes` is `--ban-strikes` and `PET_GATEWAY_BAN_STRIKES`.
    Rule,
    /// A spelling older than the rule, kept because operators script against it.
    Own(&'static str),
    /// Not in this layer (a secret is never a flag: flags show in `ps`).
    Never,
}

/// A setting, apart from the type its check produces: what the layers and the tables need.
#[derive(Debug, Clone, Copy)]
pub struct Row {
    /// The file's key; `ban.strikes` is `strikes` in the file's `[ban]` table.
    pub name: &'static str,
    pub kind: Kind,
    flag: Spelling,
    /// The flag's value in help and the book; `None`: one by the kind (`N`, `PATH`).
    value_name: Option<&'static str>,
    keys_commands_only: bool,
    env: Spelling,
    pub preset: Preset,
    /// Never a flag (flags show in `ps`) and never printed.
    pub secret: bool,
    pub doc: &'static str,
}

/// A row with the check that turns its value into what [`super::Config`] holds.
#[derive(Debug, Clone, Copy)]
pub struct Setting<T> {
    pub row: Row,
    pub parse: fn(Value) -> Result<T, String>,
}

impl<T> Setting<T> {
    /// A setting in the file, its flag and its variable, both spelled by the rule.
    pub const fn new(
        name: &'static str,
        kind: Kind,
        preset: Preset,
        doc: &'static str,
        parse: fn(Value) -> Result<T, String>,
    ) -> Setting<T> {
        Setting {
            row: Row {
                name,
                kind,
                flag: Spelling::Rule,
                value_name: None,
                keys_commands_only: false,
                env: Spelling::Rule,
                preset,
                secret: false,
                doc,
            },
            parse,
        }
    }

    /// A flag spelled otherwise than the rule would: only the spellings older than the rule.
    pub const fn flag(mut self, name: &'static str, value_name: &'static str) -> Setting<T> {
        self.row.flag = Spelling::Own(name);
        self.row.value_name = Some(value_name);
        self
    }

    /// What the flag's value is called in help and the book, when the kind's word says too little.
    pub const fn value_name(mut self, value_name: &'static str) -> Setting<T> {
        self.row.value_name = Some(value_name);
        self
    }

    /// The flag is taken by the `keys` commands only (`--audit-log`: `serve` writes no audit).
    pub const fn keys_commands_only(mut self) -> Setting<T> {
        self.row.keys_commands_only = true;
        self
    }

    /// A variable spelled otherwise than the rule would: only the spellings older than the rule.
    pub const fn env(mut self, var: &'static str) -> Setting<T> {
        self.row.env = Spelling::Own(var);
        self
    }

    /// In the file or the environment, never a flag, never shown.
    pub const fn secret(mut self) -> Setting<T> {
        self.row.flag = Spelling::Never;
        self.row.secret = true;
        self
    }
}

impl Value {
    /// A literal default or a variable's text, as `kind` reads it.
    pub fn from_text(kind: Kind, text: &str) -> Value {
        match kind {
            Kind::Path => Value::Path(PathBuf::from(text)),
            Kind::Texts => Value::Texts(list(text)),
            _ => Value::Text(text.to_owned()),
        }
    }

    pub fn text(self) -> Result<String, String> {
        match self {
            Value::Text(t) => Ok(t),
            Value::Path(p) => p
                .into_os_string()
                .into_string()
                .map_err(|p| format!("`{}` is not UTF-8", p.to_string_lossy())),
            other => Err(format!("expected text, not `{}`", other.render())),
        }
    }

    pub fn path(self) -> Result<PathBuf, String> {
        match self {
            Value::Path(p) => Ok(p),
            Value::Text(t) => Ok(PathBuf::from(t)),
            other => Err(format!("expected a path, not `{}`", other.render())),
        }
    }

    /// A whole number that fits `T`; a variable's text is parsed here.
    pub fn int<T: TryFrom<u64>>(self) -> Result<T, String> {
        let n = match self {
            Value::Int(n) => n,
            Value::Text(t) => number(&t)?,
            other => return Err(format!("expected a number, not `{}`", other.render())),
        };
        T::try_from(n).map_err(|_| {
            let type_name = std::any::type_name::<T>();
            format!("invalid value: integer `{n}`, expected {type_name}")
        })
    }

    pub fn bool(self) -> Result<bool, String> {
        match self {
            Value::Bool(b) => Ok(b),
            Value::Text(t) => t
                .parse()
                .map_err(|_| format!("`{t}` is not `true` or `false`")),
            other => Err(format!("expected true or false, not `{}`", other.render())),
        }
    }

    pub fn texts(self) -> Result<Vec<String>, String> {
        match self {
            Value::Texts(v) => Ok(v),
            Value::Text(t) => Ok(list(&t)),
            other => Err(format!("expected a list, not `{}`", other.render())),
        }
    }

    pub fn ints(self) -> Result<Vec<u64>, String> {
        match self {
            Value::Ints(v) => Ok(v),
            Value::Text(t) if t.trim().is_empty() => Ok(Vec::new()),
            Value::Text(t) => t.split(',').map(number).collect(),
            other => Err(format!(
                "expected a list of numbers, not `{}`",
                other.render()
            )),
        }
    }

    /// As the file would spell it, less the quotes of a lone string.
    pub fn render(&self) -> String {
        match self {
            Value::Text(t) => t.clone(),
            Value::Path(p) => p.display().to_string(),
            Value::Int(n) => n.to_string(),
            Value::Bool(b) => b.to_string(),
            Value::Texts(v) => {
                let quoted: Vec<String> = v.iter().map(|t| format!("{t:?}")).collect();
                format!("[{}]", quoted.join(", "))
            }
            Value::Ints(v) => {
                let shown: Vec<String> = v.iter().map(u64::to_string).collect();
                format!("[{}]", shown.join(", "))
            }
        }
    }
}

/// A list as a variable or a literal default spells it: comma-separated, each item trimmed. An
/// empty text is one empty item, which the setting's check refuses, never the empty list: an
/// empty `PET_GATEWAY_REGISTRY_VERIFY_KEYS` (a Secret's key left blank) must not switch the
/// signature check off.
fn list(text: &str) -> Vec<String> {
    text.split(',').map(|item| item.trim().to_owned()).collect()
}

/// What every setting's variable starts with.
pub const ENV_PREFIX: &str = "PET_GATEWAY_";

/// The words of a file key, for the rule's spellings: `ban.strikes` is `ban`, `strikes`, and
/// `upstream_priority.listPets` is `upstream`, `priority`, `list`, `pets`.
fn words(name: &str) -> Vec<String> {
    let mut words = Vec::new();
    for part in name.split(['.', '_']) {
        let mut word = String::new();
        for c in part.chars() {
            if c.is_ascii_uppercase() && !word.is_empty() {
                words.push(std::mem::take(&mut word));
            }
            word.push(c.to_ascii_lowercase());
        }
        words.push(word);
    }
    words
}

/// A spelling made by the rule, kept for the process's life as clap and [`Origin`] need: each
/// distinct one is made once, so this holds at most two a row.
fn intern(text: String) -> &'static str {
    static SPELLINGS: Mutex<BTreeSet<&'static str>> = Mutex::new(BTreeSet::new());
    let mut spellings = SPELLINGS.lock().unwrap_or_else(PoisonError::into_inner);
    if let Some(known) = spellings.get(text.as_str()) {
        return known;
    }
    let made: &'static str = Box::leak(text.into_boxed_str());
    spellings.insert(made);
    made
}

fn number(text: &str) -> Result<u64, String> {
    text.trim()
        .parse()
        .map_err(|_| format!("`{text}` is not a whole number"))
}

impl Row {
    /// The flag that sets this row: its own spelling, else the rule's; none for a secret.
    pub fn flag(&self) -> Option<Flag> {
        let name = match self.flag {
            Spelling::Never => return None,
            Spelling::Own(name) => name,
            Spelling::Rule => intern(format!("--{}", words(self.name).join("-"))),
        };
        Some(Flag {
            name,
            value_name: self.value_name.unwrap_or(match self.kind {
                Kind::Text => "TEXT",
                Kind::Path => "PATH",
                Kind::Int | Kind::Ints | Kind::Number => "N",
                Kind::Bool => "BOOL",
                Kind::Texts => "ITEM",
                Kind::Choice(_) => "NAME",
            }),
            serve: !self.keys_commands_only,
        })
    }

    /// The variable that sets this row: its own spelling, else the rule's.
    pub fn env(&self) -> Option<&'static str> {
        match self.env {
            Spelling::Never => None,
            Spelling::Own(var) => Some(var),
            Spelling::Rule => {
                let words = words(self.name).join("_").to_ascii_uppercase();
                Some(intern(format!("{ENV_PREFIX}{words}")))
            }
        }
    }

    /// Whether the flag or the variable is spelled otherwise than the rule.
    #[cfg(test)]
    pub fn spelled_its_own_way(&self) -> bool {
        matches!(self.flag, Spelling::Own(_)) || matches!(self.env, Spelling::Own(_))
    }

    /// The preset's value, if it has one of its own.
    fn preset_value(&self) -> Option<Value> {
        match self.preset {
            Preset::Value(text) if text.is_empty() => Some(match self.kind {
                Kind::Texts => Value::Texts(Vec::new()),
                Kind::Ints => Value::Ints(Vec::new()),
                kind => Value::from_text(kind, text),
            }),
            Preset::Value(text) => Some(Value::from_text(self.kind, text)),
            Preset::Of(value) => Some(value()),
            Preset::Computed(_) | Preset::Absent(_) => None,
        }
    }

    /// The default as the book's table shows it.
    pub fn preset_doc(&self) -> String {
        match self.preset {
            Preset::Computed(doc) | Preset::Absent(doc) => doc.to_owned(),
            _ => match self.preset_value() {
                Some(v) => format!("`{}`", v.render()),
                None => String::new(),
            },
        }
    }

    /// For `check`'s report, which people paste into tickets: a secret is never shown, nor the
    /// password a Redis URL may carry, nor a URL's query (where a webhook receiver may take a
    /// token).
    fn shown(&self, value: &Value) -> String {
        if self.secret {
            return "(set)".to_owned();
        }
        let mut shown = value.render();
        if let Some(query) = shown.find('?').filter(|_| shown.contains("://")) {
            shown.replace_range(query.., "?(hidden)");
        }
        if !shown.contains('@') {
            return shown;
        }
        let parts: Vec<String> = shown.split(',').map(crate::base::redis::redact).collect();
        parts.join(",")
    }
}

/// Which layer gave a value.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Origin {
    Default,
    File(PathBuf),
    Env(&'static str),
    Flag(&'static str),
}

impl Origin {
    /// An error about `row`'s value, naming where that value came from.
    pub fn error(&self, row: &Row, message: String) -> ConfigError {
        let (source_name, name) = match self {
            Origin::Default => ("built-in default".to_owned(), format!("`{}`", row.name)),
            Origin::File(path) => (path.display().to_string(), format!("field `{}`", row.name)),
            Origin::Env(var) => ("environment".to_owned(), (*var).to_owned()),
            Origin::Flag(flag) => ("command line".to_owned(), (*flag).to_owned()),
        };
        ConfigError::Invalid {
            source_name,
            message: format!("{name}: {message}"),
        }
    }

    /// For `check`'s report: which layer, without the file's path (printed above it).
    pub fn label(&self) -> String {
        match self {
            Origin::Default => "default".to_owned(),
            Origin::File(_) => "file".to_owned(),
            Origin::Env(var) => format!("env {var}"),
            Origin::Flag(flag) => format!("flag {flag}"),
        }
    }
}

/// One layer's values, by setting name: every layer produces this one shape, so merging is the
/// same for all of them.
#[derive(Debug, Clone, Default)]
pub struct Layer {
    values: HashMap<&'static str, Value>,
}

impl Layer {
    pub fn set(&mut self, name: &'static str, value: Value) {
        self.values.insert(name, value);
    }

    pub fn get(&self, name: &str) -> Option<&Value> {
        self.values.get(name)
    }
}

/// A value and the layer it came from.
#[derive(Debug, Clone)]
pub struct Sourced<T> {
    pub value: T,
    pub origin: Origin,
    row: Row,
}

impl<T> Sourced<T> {
    /// An error about this value, naming the layer that gave it.
    pub fn error(&self, message: String) -> ConfigError {
        self.origin.error(&self.row, message)
    }

    /// The setting's name (its file key).
    pub fn name(&self) -> &'static str {
        self.row.name
    }

    /// A value that may be absent (an empty `redis_url`) as a value or none.
    pub fn transpose<U>(self) -> Option<Sourced<U>>
    where
        T: Into<Option<U>>,
    {
        let Sourced { value, origin, row } = self;
        value.into().map(|value| Sourced { value, origin, row })
    }

    /// The setting and the layer without the value: to blame in an error found later, when
    /// the value has moved on (a password never stays in an error).
    pub fn blame(&self) -> Sourced<()> {
        Sourced {
            value: (),
            origin: self.origin.clone(),
            row: self.row,
        }
    }
}

/// What `check` reports of one setting: the value in force and where it came from.
#[derive(Debug, Clone)]
pub struct Resolved {
    pub name: &'static str,
    pub shown: String,
    pub origin: Origin,
}

/// The layers, highest precedence first, and a record of every value the parts took.
#[derive(Debug, Default)]
pub struct Layers {
    pub flags: Layer,
    pub env: Layer,
    pub file: Layer,
    pub file_path: Option<PathBuf>,
    pub resolved: RefCell<Vec<Resolved>>,
}

impl Layers {
    /// The value of the highest layer that gives one: flags > environment > file.
    pub fn given(&self, row: &Row) -> Option<(Value, Origin)> {
        if let (Some(v), Some(flag)) = (self.flags.get(row.name), row.flag()) {
            return Some((v.clone(), Origin::Flag(flag.name)));
        }
        if let (Some(v), Some(var)) = (self.env.get(row.name), row.env()) {
            return Some((v.clone(), Origin::Env(var)));
        }
        match (self.file.get(row.name), &self.file_path) {
            (Some(v), Some(path)) => Some((v.clone(), Origin::File(path.clone()))),
            _ => None,
        }
    }

    /// The checked value of the highest layer that gives one, else of the preset; `None` when
    /// neither does (a computed or absent preset).
    pub fn get<T>(&self, s: &Setting<T>) -> Result<Option<Sourced<T>>, ConfigError> {
        let row = &s.row;
        let given = self
            .given(row)
            .or_else(|| row.preset_value().map(|v| (v, Origin::Default)));
        let Some((value, origin)) = given else {
            if let Preset::Absent(doc) = row.preset {
                let shown = if row.secret { "(unset)" } else { doc };
                let shown = shown.trim_start_matches("absent: ").replace('`', "");
                self.record(row, shown, Origin::Default);
            }
            return Ok(None);
        };
        self.check(s, value, origin).map(Some)
    }

    /// As [`Self::get`], with `computed` in place of a preset the part works out.
    pub fn or<T>(&self, s: &Setting<T>, computed: Value) -> Result<Sourced<T>, ConfigError> {
        match self.given(&s.row) {
            Some((value, origin)) => self.check(s, value, origin),
            None => self.check(s, computed, Origin::Default),
        }
    }

    /// The value of a setting whose preset gives one, and where it came from.
    pub fn required<T>(&self, s: &Setting<T>) -> Result<Sourced<T>, ConfigError> {
        self.get(s)?
            .ok_or_else(|| Origin::Default.error(&s.row, "has no default".to_owned()))
    }

    /// For the settings no later check blames.
    pub fn value<T>(&self, s: &Setting<T>) -> Result<T, ConfigError> {
        self.required(s).map(|sourced| sourced.value)
    }

    fn check<T>(
        &self,
        s: &Setting<T>,
        value: Value,
        origin: Origin,
    ) -> Result<Sourced<T>, ConfigError> {
        let row = s.row;
        let shown = row.shown(&value);
        let value = (s.parse)(value).map_err(|m| origin.error(&row, m))?;
        self.record(&row, shown, origin.clone());
        Ok(Sourced { value, origin, row })
    }

    fn record(&self, row: &Row, shown: String, origin: Origin) {
        self.resolved.borrow_mut().push(Resolved {
            name: row.name,
            shown,
            origin,
        });
    }
}
