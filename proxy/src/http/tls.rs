//! TLS termination on the public listener (rustls through pingora): TLS 1.2 and 1.3 only,
//! HTTP/2 and HTTP/1.1 offered by ALPN. The certificate is served by a resolver that holds the
//! current certificate behind an atomic pointer, so a renewed certificate is swapped in (file
//! change or SIGHUP) for new handshakes while established connections carry on untouched.

use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::SystemTime;

use arc_swap::ArcSwap;
use rustls::server::{ClientHello, ResolvesServerCert};
use rustls::sign::CertifiedKey;

#[derive(Debug, thiserror::Error)]
pub enum TlsError {
    #[error("{}: {message}", path.display())]
    Load { path: PathBuf, message: String },
}

/// The certificate in force and where it comes from.
pub struct CertResolver {
    current: ArcSwap<CertifiedKey>,
    cert_path: PathBuf,
    key_path: PathBuf,
    seen: Mutex<Vec<Option<(u64, SystemTime)>>>,
}

impl std::fmt::Debug for CertResolver {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CertResolver")
            .field("cert_path", &self.cert_path)
            .finish_non_exhaustive()
    }
}

impl CertResolver {
    pub fn load(cert_path: &Path, key_path: &Path) -> Result<CertResolver, TlsError> {
        let seen = fingerprint(cert_path, key_path);
        Ok(CertResolver {
            current: ArcSwap::from_pointee(load_certified_key(cert_path, key_path)?),
            cert_path: cert_path.to_owned(),
            key_path: key_path.to_owned(),
            seen: Mutex::new(seen),
        })
    }

    /// Reloads when the files changed (or always, when `force`). A bad pair is refused with a
    /// log line and the current certificate stays. Returns whether a new one was applied.
    pub fn reload(&self, force: bool) -> Option<bool> {
        let now_seen = fingerprint(&self.cert_path, &self.key_path);
        {
            let mut seen = self.seen.lock().unwrap_or_else(|p| p.into_inner());
            if !force && *seen == now_seen {
                return None;
            }
            *seen = now_seen;
        }
        match load_certified_key(&self.cert_path, &self.key_path) {
            Ok(key) => {
                self.current.store(Arc::new(key));
                tracing::info!(cert = %self.cert_path.display(), "TLS certificate reloaded");
                Some(true)
            }
            Err(e) => {
                tracing::error!(error = %e, "TLS certificate reload refused; the previous one stays");
                Some(false)
            }
        }
    }
}

impl ResolvesServerCert for CertResolver {
    fn resolve(&self, _hello: ClientHello<'_>) -> Option<Arc<CertifiedKey>> {
        Some(self.current.load_full())
    }
}

fn fingerprint(cert: &Path, key: &Path) -> Vec<Option<(u64, SystemTime)>> {
    [cert, key]
        .iter()
        .map(|p| {
            let m = std::fs::metadata(p).ok()?;
            Some((m.len(), m.modified().ok()?))
        })
        .collect()
}

fn load_certified_key(cert_path: &Path, key_path: &Path) -> Result<CertifiedKey, TlsError> {
    let err = |path: &Path, message: String| TlsError::Load {
        path: path.to_owned(),
        message,
    };
    let (certs, key) = pingora::tls::load_certs_and_key_files(
        &cert_path.to_string_lossy(),
        &key_path.to_string_lossy(),
    )
    .map_err(|e| {
        err(
            cert_path,
            format!("cannot read the certificate or key: {e}"),
        )
    })?
    .ok_or_else(|| {
        err(
            cert_path,
            format!(
                "no certificate in it, or no private key in {}",
                key_path.display()
            ),
        )
    })?;
    let signing_key = rustls::crypto::ring::sign::any_supported_type(&key)
        .map_err(|e| err(key_path, format!("unusable private key: {e}")))?;
    let certified = CertifiedKey::new(certs, signing_key);
    certified.keys_match().map_err(|e| {
        err(
            key_path,
            format!("the key does not match the certificate: {e}"),
        )
    })?;
    Ok(certified)
}
