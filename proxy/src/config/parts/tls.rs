//! TLS on the public listener: a certificate and its key, both or neither.

use std::path::PathBuf;

use crate::config::model::{ConfigError, TlsFiles};
use crate::config::setting::{Kind, Layers, Preset, Row, Setting, Value};

const TLS_CERT: Setting<PathBuf> = Setting::new(
    "tls_cert",
    Kind::Path,
    Preset::Absent("absent: plain HTTP"),
    "PEM certificate chain, leaf first; with `tls_key`, the public listener speaks TLS 1.2/1.3 \
     with HTTP/2 and HTTP/1.1 (ALPN)",
    Value::path,
);
const TLS_KEY: Setting<PathBuf> = Setting::new(
    "tls_key",
    Kind::Path,
    Preset::Absent("absent: plain HTTP"),
    "PEM private key of `tls_cert`",
    Value::path,
);

pub const SETTINGS: &[Row] = &[TLS_CERT.row, TLS_KEY.row];

pub fn validate(l: &Layers) -> Result<Option<TlsFiles>, ConfigError> {
    match (l.get(&TLS_CERT)?, l.get(&TLS_KEY)?) {
        (Some(cert), Some(key)) => Ok(Some(TlsFiles {
            cert: cert.value,
            key: key.value,
        })),
        (None, None) => Ok(None),
        (Some(given), None) | (None, Some(given)) => Err(given.error(
            "tls_cert and tls_key go together: give both (TLS) or neither (plain HTTP)".into(),
        )),
    }
}
