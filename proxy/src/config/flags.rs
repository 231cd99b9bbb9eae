//! The command-line layer (clap, one flag per row that has one) and the environment layer beside
//! it.
//!
//! The environment is read here rather than by clap, so that a value remembers whether it came
//! from a flag or a variable and an error can name the one that really supplied it.

use std::collections::HashMap;
use std::path::PathBuf;

use clap::builder::PossibleValuesParser;
use clap::{Arg, ArgAction, ArgMatches};

use super::parts::rows;
use super::setting::{Flag, Kind, Layer, Row, Value};

/// Which rows' flags a command takes.
#[derive(Debug, Clone, Copy)]
pub enum FlagSet {
    /// `serve` and `check`: every flag but those of the `keys` commands only.
    Serve,
    /// These settings' flags, by name.
    Named(&'static [&'static str]),
}

impl FlagSet {
    fn rows(self) -> impl Iterator<Item = (&'static Row, Flag)> {
        rows()
            .filter_map(|row| row.flag.map(|flag| (row, flag)))
            .filter(move |(row, flag)| match self {
                FlagSet::Serve => flag.serve,
                FlagSet::Named(names) => names.contains(&row.name),
            })
    }
}

/// The environment variable of the setting named `name`, if it has one.
pub fn env_var(name: &str) -> Option<&'static str> {
    rows().find(|row| row.name == name).and_then(|row| row.env)
}

/// The flags that override the file and the environment: the flag layer.
#[derive(Debug, Clone, Default)]
pub struct Overrides {
    layer: Layer,
}

impl Overrides {
    /// Adds the flags of `set` to a command, each with its row's doc as help.
    pub fn add_args(cmd: clap::Command, set: FlagSet) -> clap::Command {
        set.rows()
            .fold(cmd, |cmd, (row, flag)| cmd.arg(flag_arg(row, flag)))
    }

    /// The flags of `set` that the command line gave.
    pub fn from_matches(m: &ArgMatches, set: FlagSet) -> Overrides {
        let mut layer = Layer::default();
        for (row, _) in set.rows() {
            if let Some(value) = flag_value(m, row) {
                layer.set(row.name, value);
            }
        }
        Overrides { layer }
    }

    /// A setting's flag given by a command's own argument rather than the table's flag (the
    /// `keys` commands' `--admin-listen`); `None` leaves it unset.
    pub fn with(mut self, name: &str, value: Option<&str>) -> Overrides {
        let row = rows().find(|r| r.name == name && r.flag.is_some());
        debug_assert!(row.is_some(), "`{name}` is no setting with a flag");
        if let (Some(row), Some(value)) = (row, value) {
            self.layer.set(row.name, Value::from_text(row.kind, value));
        }
        self
    }

    pub(super) fn layer(&self) -> &Layer {
        &self.layer
    }
}

fn flag_arg(row: &'static Row, flag: Flag) -> Arg {
    let help = match row.env {
        Some(var) => format!("{} [env: {var}]", row.doc),
        None => row.doc.to_owned(),
    };
    let arg = Arg::new(row.name)
        .long(flag.name.trim_start_matches('-'))
        .value_name(flag.value_name)
        .help(help);
    match row.kind {
        Kind::Text | Kind::Number => arg.value_parser(clap::value_parser!(String)),
        Kind::Path => arg.value_parser(clap::value_parser!(PathBuf)),
        Kind::Int => arg.value_parser(clap::value_parser!(u64)),
        Kind::Bool => arg.value_parser(clap::value_parser!(bool)),
        Kind::Choice(names) => arg.value_parser(PossibleValuesParser::new(names())),
        Kind::Texts => arg
            .value_parser(clap::value_parser!(String))
            .action(ArgAction::Append)
            .value_delimiter(','),
        Kind::Ints => arg
            .value_parser(clap::value_parser!(u64))
            .action(ArgAction::Append)
            .value_delimiter(','),
    }
}

/// The value clap parsed for `row`, as its kind holds it; an empty list is no value.
fn flag_value(m: &ArgMatches, row: &Row) -> Option<Value> {
    fn one<T: Clone + Send + Sync + 'static>(m: &ArgMatches, id: &str) -> Option<T> {
        m.try_get_one::<T>(id).ok().flatten().cloned()
    }
    fn many<T: Clone + Send + Sync + 'static>(m: &ArgMatches, id: &str) -> Option<Vec<T>> {
        let values: Vec<T> = m.try_get_many::<T>(id).ok().flatten()?.cloned().collect();
        (!values.is_empty()).then_some(values)
    }
    let id = row.name;
    match row.kind {
        Kind::Text | Kind::Choice(_) | Kind::Number => one::<String>(m, id).map(Value::Text),
        Kind::Path => one::<PathBuf>(m, id).map(Value::Path),
        Kind::Int => one::<u64>(m, id).map(Value::Int),
        Kind::Bool => one::<bool>(m, id).map(Value::Bool),
        Kind::Texts => many::<String>(m, id).map(Value::Texts),
        Kind::Ints => many::<u64>(m, id).map(Value::Ints),
    }
}

impl clap::FromArgMatches for Overrides {
    fn from_arg_matches(m: &ArgMatches) -> Result<Self, clap::Error> {
        Ok(Overrides::from_matches(m, FlagSet::Serve))
    }

    fn update_from_arg_matches(&mut self, m: &ArgMatches) -> Result<(), clap::Error> {
        *self = Overrides::from_matches(m, FlagSet::Serve);
        Ok(())
    }
}

impl clap::Args for Overrides {
    fn augment_args(cmd: clap::Command) -> clap::Command {
        Overrides::add_args(cmd, FlagSet::Serve)
    }

    fn augment_args_for_update(cmd: clap::Command) -> clap::Command {
        Overrides::add_args(cmd, FlagSet::Serve)
    }
}

/// The `PET_GATEWAY_*` variables of a process: a snapshot, so tests can give their own.
#[derive(Debug, Clone, Default)]
pub struct Env {
    vars: HashMap<String, String>,
}

impl Env {
    /// This process's `PET_GATEWAY_*` variables. `vars_os`, not `vars`: an unrelated variable
    /// that is not UTF-8 must not abort the gateway; one of ours that is not is left out.
    pub fn process() -> Env {
        Env {
            vars: std::env::vars_os()
                .filter_map(|(k, v)| Some((k.into_string().ok()?, v.into_string().ok()?)))
                .filter(|(k, _)| k.starts_with("PET_GATEWAY_"))
                .collect(),
        }
    }

    /// Only the variables of the named settings: a command that needs a few settings (`keys`,
    /// `bans`) is not stopped by a bad value of one it never uses.
    pub fn only(mut self, settings: &[&str]) -> Env {
        let vars: Vec<&str> = settings.iter().filter_map(|name| env_var(name)).collect();
        self.vars.retain(|k, _| vars.contains(&k.as_str()));
        self
    }

    pub fn from_pairs<'a>(pairs: impl IntoIterator<Item = (&'a str, &'a str)>) -> Env {
        Env {
            vars: pairs
                .into_iter()
                .map(|(k, v)| (k.to_owned(), v.to_owned()))
                .collect(),
        }
    }

    /// This layer, unchecked: a value is checked only if it wins the merge, so a flag makes a
    /// bad variable of the same setting irrelevant.
    pub(super) fn layer(&self) -> Layer {
        let mut layer = Layer::default();
        for row in rows() {
            if let Some(text) = row.env.and_then(|var| self.vars.get(var)) {
                layer.set(row.name, Value::from_text(row.kind, text));
            }
        }
        layer
    }
}
