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
use super::setting::{Flag, Kind, Layer, Row, Value, ENV_PREFIX};

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
            .filter_map(|row| row.flag().map(|flag| (row, flag)))
            .filter(move |(row, flag)| match self {
                FlagSet::Serve => flag.serve,
                FlagSet::Named(names) => names.contains(&row.name),
            })
    }
}

/// The environment variable of the setting named `name`, if it has one.
pub fn env_var(name: &str) -> Option<&'static str> {
    rows().find(|row| row.name == name).and_then(Row::env)
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
        let row = rows().find(|r| r.name == name && r.flag().is_some());
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
    let help = match row.env() {
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
    /// Our variables whose value is not UTF-8: refused by [`Env::layer`]'s caller rather than
    /// left out, which would leave the setting at its file's value without a word (an
    /// unreadable `PET_GATEWAY_REGISTRY_VERIFY_KEYS` would switch the signature check off).
    not_utf8: Vec<String>,
}

impl Env {
    /// This process's `PET_GATEWAY_*` variables. `vars_os`, not `vars`: an unrelated variable
    /// that is not UTF-8 must not abort the gateway; one of ours that is not is kept aside.
    pub fn process() -> Env {
        let mut env = Env::default();
        for (k, v) in std::env::vars_os() {
            let Some(k) = k.into_string().ok().filter(|k| k.starts_with(ENV_PREFIX)) else {
                continue;
            };
            match v.into_string() {
                Ok(v) => {
                    env.vars.insert(k, v);
                }
                Err(_) => env.not_utf8.push(k),
            }
        }
        env
    }

    /// The first setting's variable whose value is not UTF-8, as the error that refuses it
    /// (named, its value never shown: it may be a secret).
    pub(super) fn unreadable(&self) -> Option<String> {
        let known: Vec<&str> = rows().filter_map(Row::env).collect();
        let mut bad: Vec<&String> = self
            .not_utf8
            .iter()
            .filter(|var| known.contains(&var.as_str()))
            .collect();
        bad.sort();
        bad.first()
            .map(|var| format!("{var}: its value is not UTF-8"))
    }

    /// Only the variables of the named settings: a command that needs a few settings (`keys`,
    /// `bans`) is not stopped by a bad value of one it never uses.
    pub fn only(mut self, settings: &[&str]) -> Env {
        let vars: Vec<&str> = settings.iter().filter_map(|name| env_var(name)).collect();
        self.vars.retain(|k, _| vars.contains(&k.as_str()));
        self.not_utf8.retain(|k| vars.contains(&k.as_str()));
        self
    }

    pub fn from_pairs<'a>(pairs: impl IntoIterator<Item = (&'a str, &'a str)>) -> Env {
        Env {
            vars: pairs
                .into_iter()
                .map(|(k, v)| (k.to_owned(), v.to_owned()))
                .collect(),
            not_utf8: Vec::new(),
        }
    }

    /// One line for each `PET_GATEWAY_*` variable that no setting reads (a misspelling, or a
    /// setting since renamed), with the variable it is closest to: ignored, it would otherwise
    /// leave the setting at its file's value without a word. A warning, not an error, so that a
    /// variable left over in an orchestrator's environment never stops a node starting.
    pub fn unknown(&self) -> Vec<String> {
        let known: Vec<&str> = rows().filter_map(Row::env).chain([CONFIG_VAR]).collect();
        let mut unknown: Vec<&String> = self
            .vars
            .keys()
            .filter(|var| !known.contains(&var.as_str()))
            .collect();
        unknown.sort();
        unknown
            .into_iter()
            .map(|var| {
                let nearest = known
                    .iter()
                    .map(|k| (distance(var, k), *k))
                    .min()
                    .filter(|(d, _)| *d <= 3);
                let hint =
                    nearest.map_or_else(String::new, |(_, k)| format!(" (did you mean {k}?)"));
                format!("{var} is no setting's variable and is ignored{hint}")
            })
            .collect()
    }

    /// This layer, unchecked: a value is checked only if it wins the merge, so a flag makes a
    /// bad variable of the same setting irrelevant.
    pub(super) fn layer(&self) -> Layer {
        let mut layer = Layer::default();
        for row in rows() {
            if let Some(text) = row.env().and_then(|var| self.vars.get(var)) {
                layer.set(row.name, Value::from_text(row.kind, text));
            }
        }
        layer
    }
}

/// The config file's variable, read by clap beside the settings' own.
const CONFIG_VAR: &str = "PET_GATEWAY_CONFIG";

/// Edits (insertions, deletions, substitutions) from `a` to `b`: how near a misspelling is.
fn distance(a: &str, b: &str) -> usize {
    let b: Vec<char> = b.chars().collect();
    let mut previous: Vec<usize> = (0..=b.len()).collect();
    for (i, ca) in a.chars().enumerate() {
        let mut current = vec![i + 1];
        for (j, cb) in b.iter().enumerate() {
            let substitute = previous[j] + usize::from(ca != *cb);
            current.push(substitute.min(previous[j + 1] + 1).min(current[j] + 1));
        }
        previous = current;
    }
    previous[b.len()]
}

#[cfg(test)]
mod tests {
    use std::path::Path;

    use super::*;
    use crate::config::{repo_file, settings_report, Config};

    /// The flags `serve` takes, parsed from `args`.
    fn serve_flags(args: &[&str]) -> Result<Overrides, clap::Error> {
        let cmd = Overrides::add_args(clap::Command::new("t"), FlagSet::Serve);
        let m = cmd.try_get_matches_from(std::iter::once("t").chain(args.iter().copied()))?;
        Ok(Overrides::from_matches(&m, FlagSet::Serve))
    }

    fn load(file: Option<&Path>, env: &[(&str, &str)], args: &[&str]) -> Config {
        let env = Env::from_pairs(env.iter().copied());
        Config::load(file, &env, &serve_flags(args).unwrap()).unwrap()
    }

    fn error(env: &[(&str, &str)]) -> String {
        let env = Env::from_pairs(env.iter().copied());
        Config::load(None, &env, &Overrides::default())
            .unwrap_err()
            .to_string()
    }

    /// The rows whose flag or variable is spelled otherwise than the rule, from before it.
    const OWN_SPELLINGS: &[&str] = &["admin_hosts", "upstreams", "registry_verify_keys"];

    /// The next setting cannot forget a layer: every row has a variable by the rule and a flag by
    /// the rule, but for the secrets (never a flag) and the spellings older than the rule; the
    /// book names the secrets that have no flag.
    #[test]
    fn every_setting_has_a_variable_and_a_flag_unless_it_is_a_secret() {
        let chapter = repo_file("docs/src/operating/configuration.md");
        let never_a_flag = chapter
            .split("\n\n")
            .find(|p| p.contains("never a flag:"))
            .expect("the chapter says which settings are never a flag");
        let (mut flags, mut vars) = (Vec::new(), Vec::new());
        for row in rows() {
            let var = row
                .env()
                .unwrap_or_else(|| panic!("{} has no variable", row.name));
            assert!(var.starts_with(ENV_PREFIX), "{var}");
            vars.push(var);
            match row.flag() {
                Some(flag) => {
                    assert!(
                        !row.secret,
                        "{}: a secret's flag would show in `ps`",
                        row.name
                    );
                    flags.push(flag.name);
                    let by_rule =
                        format!("--{}", var[ENV_PREFIX.len()..].to_lowercase()).replace('_', "-");
                    if !OWN_SPELLINGS.contains(&row.name) {
                        assert_eq!(
                            flag.name, by_rule,
                            "{}: flag and variable by one rule",
                            row.name
                        );
                    }
                }
                None => {
                    assert!(row.secret, "{} has no flag and is no secret", row.name);
                    let named = format!("`{}`", row.name);
                    assert!(
                        never_a_flag.contains(&named),
                        "the book: {named} is never a flag"
                    );
                }
            }
            assert_eq!(row.spelled_its_own_way(), OWN_SPELLINGS.contains(&row.name));
        }
        for names in [&mut flags, &mut vars] {
            let count = names.len();
            names.sort();
            names.dedup();
            assert_eq!(names.len(), count, "two settings share a spelling");
        }
    }

    #[test]
    fn the_rule_spells_a_table_key_and_a_camel_case_key_word_by_word() {
        let row = |name: &str| rows().find(|r| r.name == name).unwrap();
        let spelled = |name: &str| (row(name).flag().unwrap().name, row(name).env().unwrap());
        assert_eq!(
            spelled("trusted_proxies"),
            ("--trusted-proxies", "PET_GATEWAY_TRUSTED_PROXIES")
        );
        assert_eq!(
            spelled("ban.strikes"),
            ("--ban-strikes", "PET_GATEWAY_BAN_STRIKES")
        );
        assert_eq!(
            spelled("upstream_priority.listPets"),
            (
                "--upstream-priority-list-pets",
                "PET_GATEWAY_UPSTREAM_PRIORITY_LIST_PETS"
            )
        );
        assert_eq!(env_var("threads"), Some("PET_GATEWAY_THREADS"));
    }

    #[test]
    fn trusted_proxies_come_from_a_flag_over_a_variable_over_the_file() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("gw.toml");
        std::fs::write(&path, "trusted_proxies = [\"10.0.0.0/8\"]\n").unwrap();
        let nets = |c: Config| -> Vec<String> {
            let nets = c.unauthenticated.trusted_proxies.iter();
            nets.map(ToString::to_string).collect()
        };
        assert_eq!(nets(load(Some(&path), &[], &[])), ["10.0.0.0/8"]);
        // A list is comma-separated in a variable, blanks around an item dropped.
        let env = [("PET_GATEWAY_TRUSTED_PROXIES", "192.168.0.0/16, 172.16.0.1")];
        let from_env = nets(load(Some(&path), &env, &[]));
        assert_eq!(from_env, ["192.168.0.0/16", "172.16.0.1/32"]);
        // The flag is repeated or comma-separated, and beats the variable.
        for args in [
            &[
                "--trusted-proxies",
                "10.9.0.0/16",
                "--trusted-proxies",
                "10.8.0.1",
            ][..],
            &["--trusted-proxies", "10.9.0.0/16,10.8.0.1"],
        ] {
            let from_flag = nets(load(Some(&path), &env, args));
            assert_eq!(from_flag, ["10.9.0.0/16", "10.8.0.1/32"], "{args:?}");
        }
    }

    /// Blank is no way to say "none": an empty list variable is refused, so a verify key left
    /// blank in a Secret fails the start rather than taking records unsigned.
    #[test]
    fn an_empty_list_variable_is_refused_not_taken_as_the_empty_list() {
        let e = error(&[("PET_GATEWAY_TRUSTED_PROXIES", "")]);
        assert!(
            e.starts_with("environment: PET_GATEWAY_TRUSTED_PROXIES: ``"),
            "{e}"
        );
        let e = error(&[("PET_GATEWAY_REGISTRY_VERIFY_KEYS", " ")]);
        assert!(
            e.starts_with("environment: PET_GATEWAY_REGISTRY_VERIFY_KEYS:"),
            "{e}"
        );
    }

    #[test]
    fn a_table_key_and_a_list_of_numbers_come_from_the_environment_too() {
        let env = [
            ("PET_GATEWAY_BAN_STRIKES", "3"),
            ("PET_GATEWAY_BAN_DURATIONS_SECS", "30,300"),
            ("PET_GATEWAY_WORK_STEALING", "true"),
            ("PET_GATEWAY_UPSTREAM_PRIORITY_LIST_PETS", "high"),
        ];
        let c = load(None, &env, &["--ban-strikes", "4"]);
        assert_eq!(
            (c.ban.strikes, c.ban.durations.as_slice()),
            (4, &[30, 300][..])
        );
        assert!(c.work_stealing);
        let report = settings_report(
            None,
            &Env::from_pairs(env),
            &serve_flags(&["--upstream-priority-get-pet", "low"]).unwrap(),
        )
        .unwrap();
        let line = |name: &str| -> Vec<String> {
            let line = report.lines().find(|l| l.starts_with(&format!("{name} ")));
            let words = line.unwrap_or_default().split_whitespace();
            words.map(str::to_owned).collect()
        };
        assert_eq!(
            line("upstream_priority.listPets"),
            [
                "upstream_priority.listPets",
                "high",
                "env",
                "PET_GATEWAY_UPSTREAM_PRIORITY_LIST_PETS"
            ]
        );
        assert_eq!(
            line("upstream_priority.getPet"),
            [
                "upstream_priority.getPet",
                "low",
                "flag",
                "--upstream-priority-get-pet"
            ]
        );
    }

    #[test]
    fn an_invalid_variable_is_named_in_its_error_and_a_bad_flag_is_refused_by_name() {
        let e = error(&[("PET_GATEWAY_TRUSTED_PROXIES", "10.0.0.0/8,10.0.0.0/33")]);
        assert!(
            e.starts_with("environment: PET_GATEWAY_TRUSTED_PROXIES: `10.0.0.0/33` is not"),
            "{e}"
        );
        let e = error(&[("PET_GATEWAY_BAN_STRIKES", "ten")]);
        assert_eq!(
            e,
            "environment: PET_GATEWAY_BAN_STRIKES: `ten` is not a whole number"
        );
        let e = error(&[("PET_GATEWAY_WORK_STEALING", "yes")]);
        assert!(
            e.starts_with("environment: PET_GATEWAY_WORK_STEALING: `yes`"),
            "{e}"
        );
        let e = error(&[("PET_GATEWAY_UPSTREAM_PRIORITY_LIST_PETS", "urgent")]);
        assert!(
            e.starts_with("environment: PET_GATEWAY_UPSTREAM_PRIORITY_LIST_PETS:"),
            "{e}"
        );
        let e = serve_flags(&["--ban-strikes", "ten"])
            .unwrap_err()
            .to_string();
        assert!(e.contains("--ban-strikes"), "{e}");
    }

    #[test]
    fn a_variable_no_setting_reads_is_warned_about_with_the_nearest_one() {
        let env = Env::from_pairs([
            ("PET_GATEWAY_TRUSTED_PROXY", "10.0.0.0/8"),
            ("PET_GATEWAY_NOTHING_LIKE_ANY_OF_THEM", "1"),
            ("PET_GATEWAY_CONFIG", "/etc/pet-gateway/gateway.toml"),
            ("PET_GATEWAY_LISTEN", "127.0.0.1:8080"),
        ]);
        assert_eq!(
            env.unknown(),
            [
                "PET_GATEWAY_NOTHING_LIKE_ANY_OF_THEM is no setting's variable and is ignored",
                "PET_GATEWAY_TRUSTED_PROXY is no setting's variable and is ignored (did you \
                 mean PET_GATEWAY_TRUSTED_PROXIES?)",
            ]
        );
    }
}
