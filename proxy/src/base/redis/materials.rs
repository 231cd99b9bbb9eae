//! The secrets and certificates a connection is made with, read from their files at the moment
//! of (re)connecting, and the clients built from them. Read again at every reconnection, so a
//! password or certificate rotated on disk applies without a restart; a digest of what was read
//! tells a long-lived connection whether anything changed.

use std::path::Path;

use redis::{ClientTlsConfig, IntoConnectionInfo, TlsCertificates};
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer};
use sha2::{Digest, Sha256};

use crate::base::redis::access::{Credentials, RedisAccess, Secret};
use crate::base::redis::error::RedisAccessError;

/// A username and password as read now. Never printed.
#[derive(Clone, Default)]
pub(crate) struct Login {
    pub username: Option<String>,
    pub password: Option<String>,
}

/// What connections are made with, read now.
pub(crate) struct Materials {
    pub auth: Login,
    pub sentinel_auth: Login,
    /// `Some` for a TLS connection.
    pub tls: Option<TlsCertificates>,
    /// A digest of all of it (and nothing that could be turned back into a secret).
    pub digest: [u8; 32],
}

impl RedisAccess {
    /// Reads the password files and the PEM files (blocking file reads: at start-up, on the
    /// CLI, on the registry's thread, or in the blocking pool). An error names the setting.
    pub(crate) fn read_materials(&self) -> Result<Materials, RedisAccessError> {
        let mut digest = Sha256::new();
        let auth = login(&self.auth, &mut digest)?;
        let sentinel_auth = login(&self.sentinel_auth, &mut digest)?;
        let tls = if self.tls {
            install_crypto_provider();
            Some(self.certificates(&mut digest)?)
        } else {
            None
        };
        Ok(Materials {
            auth,
            sentinel_auth,
            tls,
            digest: digest.finalize().into(),
        })
    }

    fn certificates(&self, digest: &mut Sha256) -> Result<TlsCertificates, RedisAccessError> {
        let files = &self.tls_files;
        let root_cert = match &files.ca {
            Some(path) => {
                let pem = read("redis_tls_ca_file", path)?;
                certificates_in("redis_tls_ca_file", path, &pem)?;
                digest.update(&pem);
                Some(pem)
            }
            None => None,
        };
        let client_tls = match (&files.cert, &files.key) {
            (Some(cert), Some(key)) => {
                let client_cert = read("redis_tls_cert_file", cert)?;
                certificates_in("redis_tls_cert_file", cert, &client_cert)?;
                let client_key = read("redis_tls_key_file", key)?;
                PrivateKeyDer::from_pem_slice(&client_key).map_err(|e| {
                    RedisAccessError::file(
                        "redis_tls_key_file",
                        key,
                        format!("no PEM private key: {e}"),
                    )
                })?;
                digest.update(&client_cert);
                digest.update(Sha256::digest(&client_key));
                Some(ClientTlsConfig {
                    client_cert,
                    client_key,
                })
            }
            _ => None,
        };
        Ok(TlsCertificates {
            client_tls,
            root_cert,
        })
    }
}

/// The redis crate builds its rustls configurations with the process's default provider; the
/// build may link two (ring here, aws-lc-rs through another crate of the workspace), in which
/// case rustls picks none by itself.
fn install_crypto_provider() {
    let _ = rustls::crypto::ring::default_provider().install_default();
}

fn login(c: &Credentials, digest: &mut Sha256) -> Result<Login, RedisAccessError> {
    let password = match &c.password {
        None => None,
        Some(Secret::Given { value, .. }) => Some(value.clone()),
        Some(Secret::File { path, setting }) => {
            let bytes = read(setting, path)?;
            let text = String::from_utf8(bytes)
                .map_err(|_| RedisAccessError::file(setting, path, "is not UTF-8".to_owned()))?;
            // One trailing line break is the file's, not the password's.
            let text = text.strip_suffix('\n').unwrap_or(&text);
            let text = text.strip_suffix('\r').unwrap_or(text);
            if text.is_empty() {
                return Err(RedisAccessError::file(setting, path, "is empty".to_owned()));
            }
            Some(text.to_owned())
        }
    };
    digest.update(c.username.as_deref().unwrap_or_default());
    digest.update([0]);
    digest.update(Sha256::digest(password.as_deref().unwrap_or_default()));
    Ok(Login {
        username: c.username.clone(),
        password,
    })
}

fn read(setting: &'static str, path: &Path) -> Result<Vec<u8>, RedisAccessError> {
    std::fs::read(path)
        .map_err(|e| RedisAccessError::file(setting, path, format!("cannot read: {e}")))
}

fn certificates_in(setting: &'static str, path: &Path, pem: &[u8]) -> Result<(), RedisAccessError> {
    let certs = CertificateDer::pem_slice_iter(pem)
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| RedisAccessError::file(setting, path, format!("not PEM: {e}")))?;
    if certs.is_empty() {
        return Err(RedisAccessError::file(
            setting,
            path,
            "holds no PEM certificate".to_owned(),
        ));
    }
    Ok(())
}

impl Materials {
    /// A client for the server at `url` (without user info), logging in as `login`.
    pub(crate) fn client(
        &self,
        url: &str,
        login: &Login,
    ) -> Result<redis::Client, RedisAccessError> {
        let invalid = |e: redis::RedisError| RedisAccessError::Invalid(e.to_string());
        let info = url.into_connection_info().map_err(invalid)?;
        let mut settings = info.redis_settings().clone();
        if let Some(user) = &login.username {
            settings = settings.set_username(user);
        }
        if let Some(password) = &login.password {
            settings = settings.set_password(password);
        }
        let info = info.set_redis_settings(settings);
        match (
            &self.tls,
            url.starts_with("rediss://") || url.starts_with("valkeys://"),
        ) {
            (Some(certs), true) => redis::Client::build_with_tls(info, certs.clone()),
            _ => redis::Client::open(info),
        }
        .map_err(invalid)
    }

    /// A cluster client for `nodes` (without user info); every call and connection attempt
    /// under `timeout`, with few and short retries so a call never stretches over many
    /// deadlines.
    pub(crate) fn cluster_client(
        &self,
        nodes: &[String],
        timeout: std::time::Duration,
        retries: u32,
    ) -> Result<redis::cluster::ClusterClient, RedisAccessError> {
        let mut builder = redis::cluster::ClusterClient::builder(nodes.to_vec())
            .connection_timeout(timeout)
            .response_timeout(timeout)
            .retries(retries)
            .min_retry_wait(10)
            .max_retry_wait(100);
        if let Some(user) = &self.auth.username {
            builder = builder.username(user);
        }
        if let Some(password) = &self.auth.password {
            builder = builder.password(password);
        }
        if let Some(certs) = &self.tls {
            builder = builder.certs(certs.clone());
        }
        builder
            .build()
            .map_err(|e| RedisAccessError::Invalid(e.to_string()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::base::redis::access::TlsFiles;

    fn with_password_file(path: &Path) -> RedisAccess {
        let mut a = RedisAccess::from_url("redis://h:1/0").unwrap();
        a.auth.password = Some(Secret::File {
            path: path.to_owned(),
            setting: "redis_password_file",
        });
        a
    }

    #[test]
    fn a_password_file_is_read_at_each_call_without_its_line_break() {
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("pw");
        let access = with_password_file(&file);
        let e = access.read_materials().err().unwrap().to_string();
        assert!(
            e.starts_with("redis_password_file (`") && e.contains("cannot read"),
            "{e}"
        );
        std::fs::write(&file, "first\r\n").unwrap();
        let first = access.read_materials().unwrap();
        assert_eq!(first.auth.password.as_deref(), Some("first"));
        std::fs::write(&file, "second\n").unwrap();
        let second = access.read_materials().unwrap();
        assert_eq!(second.auth.password.as_deref(), Some("second"));
        assert_ne!(first.digest, second.digest, "a rotation changes the digest");
        std::fs::write(&file, "\n").unwrap();
        let e = access.read_materials().err().unwrap().to_string();
        assert!(
            e.contains("is empty") && e.contains("redis_password_file"),
            "{e}"
        );
    }

    #[test]
    fn unreadable_or_malformed_tls_files_name_their_setting() {
        let dir = tempfile::tempdir().unwrap();
        let junk = dir.path().join("junk.pem");
        std::fs::write(&junk, "not a certificate").unwrap();
        let mut access = RedisAccess::from_url("rediss://h:1/0").unwrap();
        for (files, setting, problem) in [
            (
                TlsFiles {
                    ca: Some(junk.clone()),
                    ..TlsFiles::default()
                },
                "redis_tls_ca_file",
                "no PEM",
            ),
            (
                TlsFiles {
                    ca: Some(dir.path().join("none.pem")),
                    ..TlsFiles::default()
                },
                "redis_tls_ca_file",
                "cannot read",
            ),
            (
                TlsFiles {
                    cert: Some(junk.clone()),
                    key: Some(junk.clone()),
                    ca: None,
                },
                "redis_tls_cert_file",
                "no PEM",
            ),
        ] {
            access.tls_files = files;
            let e = access.read_materials().err().unwrap().to_string();
            assert!(e.starts_with(setting) && e.contains(problem), "{e}");
        }
    }
}
