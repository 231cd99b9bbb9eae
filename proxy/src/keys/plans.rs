//! Plan files: one TOML file per plan in the plans directory, edited by hand. The plan's name is
//! the file's name (`free.toml` is the plan `free`). Every field is checked by hand rather than
//! by a derive, so that an error names the file and the field an operator has to fix.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;

pub use crate::keys::limits::Limits;
use crate::keys::limits::{check_concurrency, Every, WindowLimit, MAX_CONCURRENCY, MAX_LIMIT};

/// The operations a plan's `[cost]` may name: `openapi.yaml`'s operation ids of what the
/// gateway forwards (`getRateLimit` is answered by the gateway and costs nothing). Their order is
/// [`Costs`]' index; `http::routes` maps a request to it and a test holds the two together.
pub const COSTED_OPERATIONS: [&str; 4] = ["listPets", "createPet", "getPet", "listOrders"];

/// What each operation costs under a plan, in units of its windows: 1 unless `[cost]` says.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Costs([u32; COSTED_OPERATIONS.len()]);

impl Default for Costs {
    fn default() -> Self {
        Costs([1; COSTED_OPERATIONS.len()])
    }
}

impl Costs {
    /// The cost of operation `index` of [`COSTED_OPERATIONS`]; 1 for anything else.
    pub fn of(&self, index: Option<usize>) -> u64 {
        index
            .and_then(|i| self.0.get(i))
            .map_or(1, |&c| u64::from(c))
    }

    /// The operations that cost more than 1, by name.
    pub fn listed(&self) -> impl Iterator<Item = (&'static str, u64)> + '_ {
        COSTED_OPERATIONS
            .iter()
            .zip(self.0)
            .filter(|&(_, c)| c != 1)
            .map(|(&name, c)| (name, u64::from(c)))
    }
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

/// `notify_at`: the percentages of a window's limit whose crossing is reported
/// (`pet.quota.threshold.v1`), as bits 1 to 100; for windows of a day or longer.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct NotifyAt(u128);

impl NotifyAt {
    /// Whether `percent` is one.
    pub fn has(self, percent: u32) -> bool {
        percent <= 100 && self.0 & (1 << percent) != 0
    }

    pub fn is_empty(self) -> bool {
        self.0 == 0
    }

    /// The percentages, lowest first: the set bits, found without looking at the others
    /// (this runs on every admitted request of a plan with thresholds).
    pub fn percents(self) -> impl Iterator<Item = u32> {
        let mut bits = self.0;
        std::iter::from_fn(move || {
            if bits == 0 {
                return None;
            }
            let p = bits.trailing_zeros();
            bits &= bits - 1;
            Some(p)
        })
    }

    /// The percentages a count going from `before` to `after` units of `limit` crosses:
    /// `before < p% of limit <= after`, the threshold's units rounded up (80 % of 7 is 6).
    pub fn crossed(self, limit: u64, before: u64, after: u64) -> impl Iterator<Item = u32> {
        self.percents().filter(move |&p| {
            let units = (u64::from(p) * limit).div_ceil(100);
            before < units && units <= after
        })
    }
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Plan {
    pub name: Arc<str>,
    /// Its windows, and its `concurrency` (the most of a key's requests in flight at once).
    pub limits: Limits,
    pub costs: Costs,
    pub notify_at: NotifyAt,
    /// `priority = N`: how many levels the plan's requests stand above (or, negative, below)
    /// their operation's level when they wait for a place at the backend.
    pub priority: i8,
}

/// The furthest a plan's `priority` may move its requests: from the lowest level to the
/// highest is three steps.
pub const MAX_PRIORITY_STEPS: i64 = 3;

#[derive(Debug, Clone, Default)]
pub struct Plans {
    by_name: HashMap<String, Arc<Plan>>,
    /// Files in the directory that are not plan files (an editor's `free.bak.toml`, a
    /// `Free.toml`, a `README.md`): skipped, and named in one warning, never fatal.
    ignored: Vec<PathBuf>,
}

const FIELDS: [&str; 8] = [
    "requests_per_minute",
    "requests_per_day",
    "window",
    "cost",
    "notify_at",
    "concurrency",
    "priority",
    "description",
];
const WINDOW_FIELDS: [&str; 3] = ["every", "limit", "shadow"];

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
            let plan = parse_plan(&text).map_err(invalid)?;
            by_name.insert(
                name.to_owned(),
                Arc::new(Plan {
                    name: name.into(),
                    ..plan
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

/// Parses one plan file's text (the first form, `requests_per_minute` and
/// `requests_per_day`, the `[[window]]` form, or both) into a plan without a name (the file's
/// gives it); the error says which field is wrong.
pub fn parse_plan(text: &str) -> Result<Plan, String> {
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
    let windows = parse_windows(&table)?;
    let limits = Limits::new(&windows).map_err(|e| format!("windows: {e}"))?;
    let Some(smallest) = limits.smallest_enforced() else {
        return Err("windows: every window is `shadow`: a plan needs one that is enforced".into());
    };
    let costs = parse_costs(table.get("cost"), smallest)?;
    let notify_at = parse_notify_at(table.get("notify_at"))?;
    let limits = match parse_concurrency(table.get("concurrency"))? {
        Some(n) => limits.with_concurrency(n),
        None => limits,
    };
    Ok(Plan {
        name: Arc::from(""),
        limits,
        costs,
        notify_at,
        priority: parse_priority(table.get("priority"))?,
    })
}

/// The plan's windows: the first form's two fields, then its `[[window]]` tables.
fn parse_windows(table: &toml::Table) -> Result<Vec<WindowLimit>, String> {
    let mut windows = Vec::new();
    let first_form = [
        ("requests_per_minute", Every::MINUTE),
        ("requests_per_day", Every::DAY),
    ];
    for (field, every) in first_form {
        match table.get(field) {
            Some(value) => windows.push(WindowLimit::new(every, whole(field, value)?)?),
            // The first form alone names both, as it always has.
            None if !table.contains_key("window") && !windows.is_empty() => {
                return Err(format!("field `{field}` is missing"));
            }
            None => {}
        }
    }
    if windows.len() == 1 && !table.contains_key("window") {
        return Err("field `requests_per_day` is missing".into());
    }
    match table.get("window") {
        None => {}
        Some(toml::Value::Array(items)) => {
            for (i, item) in items.iter().enumerate() {
                windows.push(parse_window(i, item)?);
            }
        }
        Some(_) => return Err("`window` must be [[window]] tables".into()),
    }
    if windows.is_empty() {
        return Err("field `requests_per_minute` is missing (or give [[window]] tables)".into());
    }
    Ok(windows)
}

fn parse_concurrency(value: Option<&toml::Value>) -> Result<Option<u32>, String> {
    match value {
        None => Ok(None),
        Some(toml::Value::Integer(n)) => u64::try_from(*n)
            .map_err(|_| n.to_string())
            .and_then(check_concurrency)
            .map(Some)
            .map_err(|_| concurrency_error(&n.to_string())),
        Some(v) => Err(concurrency_error(&v.to_string())),
    }
}

fn parse_priority(value: Option<&toml::Value>) -> Result<i8, String> {
    match value {
        None => Ok(0),
        Some(toml::Value::Integer(n)) if n.abs() <= MAX_PRIORITY_STEPS => Ok(*n as i8),
        Some(v) => Err(format!(
            "field `priority` must be a whole number from -{MAX_PRIORITY_STEPS} to \
             {MAX_PRIORITY_STEPS} (got {v}): the levels the plan's requests stand above \
             (or below) their operation's when they wait for the backend"
        )),
    }
}

fn concurrency_error(got: &str) -> String {
    format!(
        "field `concurrency` must be a whole number from 1 to {MAX_CONCURRENCY} (got {got}): the \
         most requests of a key, or of a customer's keys together, in flight at once"
    )
}

/// `notify_at = [80, 100]`: whole percentages from 1 to 100, each once.
fn parse_notify_at(value: Option<&toml::Value>) -> Result<NotifyAt, String> {
    let Some(value) = value else {
        return Ok(NotifyAt::default());
    };
    let Some(items) = value.as_array() else {
        return Err(format!(
            "field `notify_at` must be a list of percentages such as [80, 100] (got {value})"
        ));
    };
    let mut bits = 0u128;
    for item in items {
        let p = match item {
            toml::Value::Integer(p) if (1..=100).contains(p) => *p as u32,
            v => {
                return Err(format!(
                    "field `notify_at`: {v} is not a whole percentage from 1 to 100"
                ))
            }
        };
        if bits & (1 << p) != 0 {
            return Err(format!("field `notify_at`: {p} is given twice"));
        }
        bits |= 1 << p;
    }
    Ok(NotifyAt(bits))
}

/// A whole number from 1 to [`MAX_LIMIT`], or an error naming `field`.
fn whole(field: &str, value: &toml::Value) -> Result<u64, String> {
    match value {
        toml::Value::Integer(n) if (1..=MAX_LIMIT as i64).contains(n) => Ok(*n as u64),
        v => Err(format!(
            "field `{field}` must be a whole number from 1 to {MAX_LIMIT} (got {v})"
        )),
    }
}

/// The `i`th `[[window]]` table.
fn parse_window(i: usize, item: &toml::Value) -> Result<WindowLimit, String> {
    let at = |field: &str| format!("window[{i}].{field}");
    let Some(t) = item.as_table() else {
        return Err(format!("`window[{i}]` must be a table (`[[window]]`)"));
    };
    if let Some(unknown) = t.keys().find(|k| !WINDOW_FIELDS.contains(&k.as_str())) {
        return Err(format!(
            "unknown field `{}`; a window has {}",
            at(unknown),
            WINDOW_FIELDS.join(", ")
        ));
    }
    let every = match t.get("every") {
        Some(toml::Value::String(text)) => {
            Every::parse(text).map_err(|e| format!("field `{}`: {e}", at("every")))?
        }
        Some(v) => {
            return Err(format!(
                "field `{}` must be a string such as \"1m\" (got {v})",
                at("every")
            ))
        }
        None => return Err(format!("field `{}` is missing", at("every"))),
    };
    let limit = match t.get("limit") {
        Some(v) => whole(&at("limit"), v)?,
        None => return Err(format!("field `{}` is missing", at("limit"))),
    };
    let shadow = match t.get("shadow") {
        None => false,
        Some(toml::Value::Boolean(b)) => *b,
        Some(v) => {
            return Err(format!(
                "field `{}` must be true or false (got {v})",
                at("shadow")
            ))
        }
    };
    let mut window = WindowLimit::new(every, limit).map_err(|e| format!("{}: {e}", at("limit")))?;
    window.shadow = shadow;
    Ok(window)
}

/// `[cost]`: operation ids to their cost, each from 1 to the smallest enforced limit (an
/// operation costing more could never pass).
fn parse_costs(value: Option<&toml::Value>, smallest: u64) -> Result<Costs, String> {
    let mut costs = Costs::default();
    let Some(value) = value else {
        return Ok(costs);
    };
    let Some(table) = value.as_table() else {
        return Err("`cost` must be a table (`[cost]`) of operation ids".into());
    };
    for (operation, cost) in table {
        let field = format!("cost.{operation}");
        let Some(index) = COSTED_OPERATIONS.iter().position(|o| o == operation) else {
            let why = if operation == "getRateLimit" {
                "`getRateLimit` is answered by the gateway and costs nothing".to_owned()
            } else {
                format!(
                    "no operation `{operation}`; the operations are {}",
                    COSTED_OPERATIONS.join(", ")
                )
            };
            return Err(format!("field `{field}`: {why}"));
        };
        let n = whole(&field, cost)?;
        if n > smallest {
            return Err(format!(
                "field `{field}`: {n} is more than the smallest enforced window's limit ({smallest}): \
                 that operation could never pass"
            ));
        }
        costs.0[index] = n as u32;
    }
    Ok(costs)
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
            Limits::minute_day(60, 1000).unwrap()
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
    fn the_window_form_mixes_with_the_first_and_names_costs() {
        let text = "requests_per_minute = 300\n\
                    [[window]]\nevery = \"1s\"\nlimit = 20\n\
                    [[window]]\nevery = \"1d\"\nlimit = 10000\n\
                    [[window]]\nevery = \"month\"\nlimit = 200000\nshadow = true\n\
                    [cost]\ncreatePet = 5\n";
        let Plan { limits, costs, .. } = parse_plan(text).unwrap();
        let windows: Vec<(String, u32, bool)> = limits
            .windows()
            .iter()
            .map(|w| (w.every.spec(), w.limit, w.shadow))
            .collect();
        assert_eq!(
            windows,
            [
                ("1s".into(), 20, false),
                ("1m".into(), 300, false),
                ("1d".into(), 10_000, false),
                ("month".into(), 200_000, true)
            ]
        );
        let create = COSTED_OPERATIONS.iter().position(|o| *o == "createPet");
        assert_eq!(
            (costs.of(create), costs.of(Some(0)), costs.of(None)),
            (5, 1, 1)
        );
        // Only windows, no minute or day at all.
        let limits = parse_plan("[[window]]\nevery = \"1h\"\nlimit = 7\n")
            .unwrap()
            .limits;
        assert_eq!(limits.windows().len(), 1);
    }

    #[test]
    fn bad_windows_and_costs_name_their_field() {
        let w =
            |every: &str, limit: &str| format!("[[window]]\nevery = {every}\nlimit = {limit}\n");
        let cases = [
            (w("\"5x\"", "1"), "window[0].every"),
            (w("\"1m\"", "0"), "window[0].limit"),
            (w("\"1m\"", "4294967296"), "window[0].limit"),
            (
                format!("{}{}", w("\"1m\"", "1"), w("\"60s\"", "2")),
                "two windows of one length",
            ),
            (
                (1..=7).map(|n| w(&format!("\"{n}s\""), "9")).collect(),
                "at most 6",
            ),
            (format!("{}shadow = true\n", w("\"1m\"", "1")), "enforced"),
            (
                format!("{}burst = 1\n", w("\"1m\"", "1")),
                "window[0].burst",
            ),
            (
                format!("{}[cost]\nfeedPet = 2\n", w("\"1m\"", "5")),
                "cost.feedPet",
            ),
            (
                format!("{}[cost]\ncreatePet = 0\n", w("\"1m\"", "5")),
                "cost.createPet",
            ),
            (
                format!("{}[cost]\ncreatePet = 6\n", w("\"1m\"", "5")),
                "could never pass",
            ),
            (
                format!("{}[cost]\ngetRateLimit = 1\n", w("\"1m\"", "5")),
                "costs nothing",
            ),
            (
                "requests_per_minute = 60\n".to_owned(),
                "`requests_per_day`",
            ),
        ];
        for (text, expected) in cases {
            let dir = tempfile::tempdir().unwrap();
            write(dir.path(), "pro.toml", &text);
            let message = Plans::load_dir(dir.path()).unwrap_err().to_string();
            assert!(message.contains("pro.toml"), "{message}");
            assert!(message.contains(expected), "{text:?}: {message}");
        }
    }

    #[test]
    fn notify_at_is_read_in_both_forms_and_bad_values_name_the_field() {
        let first = "requests_per_minute = 10\nrequests_per_day = 100\nnotify_at = [100, 80]\n";
        let n = parse_plan(first).unwrap().notify_at;
        assert_eq!(n.percents().collect::<Vec<_>>(), [80, 100]);
        let windows = "notify_at = [50]\n[[window]]\nevery = \"1d\"\nlimit = 10\n";
        assert_eq!(
            parse_plan(windows)
                .unwrap()
                .notify_at
                .percents()
                .collect::<Vec<_>>(),
            [50]
        );
        assert!(
            parse_plan("requests_per_minute = 1\nrequests_per_day = 2\n")
                .unwrap()
                .notify_at
                .is_empty()
        );
        for (bad, says) in [
            ("[0]", "from 1 to 100"),
            ("[101]", "from 1 to 100"),
            ("[80, 80]", "given twice"),
            ("[\"80\"]", "from 1 to 100"),
            ("80", "a list"),
        ] {
            let text =
                format!("requests_per_minute = 1\nrequests_per_day = 2\nnotify_at = {bad}\n");
            let e = parse_plan(&text).unwrap_err();
            assert!(e.contains("notify_at") && e.contains(says), "{bad}: {e}");
        }
    }

    #[test]
    fn a_threshold_is_crossed_by_the_one_count_that_reaches_it() {
        let n =
            parse_plan("requests_per_minute = 1\nrequests_per_day = 2\nnotify_at = [80, 100]\n")
                .unwrap()
                .notify_at;
        // 80 % of 7 is 5.6 units: crossed by the request that makes it 6.
        let crossings = |before, after| n.crossed(7, before, after).collect::<Vec<_>>();
        assert_eq!(crossings(4, 5), [0u32; 0]);
        assert_eq!(crossings(5, 6), [80]);
        assert_eq!(crossings(6, 7), [100]);
        assert_eq!(
            crossings(4, 7),
            [80, 100],
            "one costly request crosses both"
        );
        assert_eq!(crossings(7, 7), [0u32; 0]);
        // Every count from 0 to the limit, one unit at a time: each threshold exactly once.
        let all: Vec<u32> = (0..1000).flat_map(|c| n.crossed(1000, c, c + 1)).collect();
        assert_eq!(all, [80, 100]);
    }

    #[test]
    fn concurrency_and_priority_are_read_in_both_forms_and_bad_values_name_the_field() {
        let first = "requests_per_minute = 10\nrequests_per_day = 100\nconcurrency = 8\n\
                     priority = -1\n";
        let plan = parse_plan(first).unwrap();
        assert_eq!((plan.limits.concurrency(), plan.priority), (Some(8), -1));
        let windows = "concurrency = 2\npriority = 3\n[[window]]\nevery = \"1d\"\nlimit = 10\n";
        let plan = parse_plan(windows).unwrap();
        assert_eq!((plan.limits.concurrency(), plan.priority), (Some(2), 3));
        let plain = parse_plan("requests_per_minute = 1\nrequests_per_day = 2\n").unwrap();
        assert_eq!((plain.limits.concurrency(), plain.priority), (None, 0));
        for (field, bad) in [
            ("concurrency", "0"),
            ("concurrency", "-3"),
            ("concurrency", "1000001"),
            ("concurrency", "\"8\""),
            ("priority", "4"),
            ("priority", "-4"),
            ("priority", "\"high\""),
        ] {
            let dir = tempfile::tempdir().unwrap();
            let text = format!("requests_per_minute = 1\nrequests_per_day = 2\n{field} = {bad}\n");
            write(dir.path(), "pro.toml", &text);
            let message = Plans::load_dir(dir.path()).unwrap_err().to_string();
            assert!(
                message.contains("pro.toml") && message.contains(&format!("`{field}`")),
                "{bad}: {message}"
            );
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
