//! How log lines are written.

use super::values::{choice, parse_choice};
use crate::config::model::{ConfigError, LogFormat};
use crate::config::setting::{Layers, Preset, Row, Setting};

const LOG_FORMAT: Setting<LogFormat> = Setting::new(
    "log_format",
    choice::<LogFormat>(),
    Preset::Value("text"),
    "`text`, or `json` (one object per line)",
    parse_choice,
)
.value_name("FORMAT");

pub const SETTINGS: &[Row] = &[LOG_FORMAT.row];

pub fn validate(l: &Layers) -> Result<LogFormat, ConfigError> {
    l.value(&LOG_FORMAT)
}
