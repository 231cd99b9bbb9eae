//! Why a connection to Redis (or a Sentinel) failed, sorted into what a restart cannot fix
//! (a wrong password, a certificate that does not verify, a master no Sentinel knows, a file
//! that cannot be read: fatal at start-up, each naming its setting) and what passes by itself
//! (refused, timed out, loading: the gateway starts anyway and `on_store_error` covers).
//! No message ever carries a password: only where it came from.

use std::path::Path;

use crate::base::redis::access::{Credentials, RedisAccess};

#[derive(Debug, Clone, thiserror::Error)]
pub enum RedisAccessError {
    #[error("{setting} (`{path}`): {problem}")]
    File {
        setting: &'static str,
        path: String,
        problem: String,
    },
    #[error("{peer}: authentication failed ({detail}); check {check}")]
    Auth {
        peer: String,
        detail: String,
        check: String,
    },
    #[error("{peer}: TLS: {detail}; {hint}")]
    Tls {
        peer: String,
        detail: String,
        hint: String,
    },
    #[error(
        "{peer}: the ACL user may not run a command the gateway needs ({detail}); regenerate \
         the users with deploy/redis/acl-users and ACL LOAD them (the book, \"Redis\")"
    )]
    Denied { peer: String, detail: String },
    #[error("redis_url: no Sentinel ({sentinels}) knows a master named `{master}`")]
    UnknownMaster { master: String, sentinels: String },
    #[error("{0}")]
    Invalid(String),
    #[error("{peer}: unreachable: {detail}")]
    Unreachable { peer: String, detail: String },
}

impl RedisAccessError {
    pub(crate) fn file(setting: &'static str, path: &Path, problem: String) -> RedisAccessError {
        RedisAccessError::File {
            setting,
            path: path.display().to_string(),
            problem,
        }
    }

    /// Whether waiting cannot help: the settings are wrong, or Redis refuses who we are.
    pub fn is_fatal(&self) -> bool {
        !matches!(self, RedisAccessError::Unreachable { .. })
    }
}

/// Which kind of node a connection went to, for the hints of an error.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Role {
    Data,
    Sentinel,
}

/// Sorts a failed connection or command to `peer` (`Redis at host:port`, `Sentinel host:port`).
pub(crate) fn classify(
    e: &redis::RedisError,
    peer: &str,
    access: &RedisAccess,
    role: Role,
) -> RedisAccessError {
    let peer = peer.to_owned();
    let code = e.code().unwrap_or_default();
    if e.kind() == redis::ErrorKind::AuthenticationFailed || matches!(code, "WRONGPASS" | "NOAUTH")
    {
        return RedisAccessError::Auth {
            peer,
            detail: e.to_string(),
            check: auth_hint(access, role),
        };
    }
    if code == "NOPERM" {
        return RedisAccessError::Denied {
            peer,
            detail: e.to_string(),
        };
    }
    if let Some(tls) = rustls_error(e) {
        return RedisAccessError::Tls {
            peer,
            detail: tls.to_string(),
            hint: tls_hint(tls, access),
        };
    }
    RedisAccessError::Unreachable {
        peer,
        detail: e.to_string(),
    }
}

fn auth_hint(access: &RedisAccess, role: Role) -> String {
    let (c, settings): (&Credentials, &str) = match role {
        Role::Data => (
            &access.auth,
            "redis_username and redis_password_file or PET_GATEWAY_REDIS_PASSWORD (or the \
             user and password in redis_url)",
        ),
        Role::Sentinel => (
            &access.sentinel_auth,
            "redis_sentinel_username and redis_sentinel_password_file or \
             PET_GATEWAY_REDIS_SENTINEL_PASSWORD",
        ),
    };
    let user = match &c.username {
        Some(u) => format!("user `{u}`"),
        None => "the default user".to_owned(),
    };
    match &c.password {
        Some(secret) => format!("{} ({user})", secret.describe()),
        None => format!("{settings}: no password is set ({user})"),
    }
}

/// The rustls error behind an I/O error of the redis crate, if any. The crate keeps the cause
/// in an `Arc<dyn Error>` and an I/O error keeps rustls's inside it; neither shows its inner
/// error as a `source`, so each wrapper is opened here.
fn rustls_error(e: &redis::RedisError) -> Option<&rustls::Error> {
    type Shared = std::sync::Arc<dyn std::error::Error + Send + Sync>;
    let mut next: Option<&(dyn std::error::Error + 'static)> = std::error::Error::source(e);
    for _ in 0..8 {
        let err = next?;
        if let Some(tls) = err.downcast_ref::<rustls::Error>() {
            return Some(tls);
        }
        next = if let Some(shared) = err.downcast_ref::<Shared>() {
            Some(&**shared)
        } else if let Some(io) = err.downcast_ref::<std::io::Error>() {
            match io.get_ref() {
                Some(inner) => Some(inner),
                None => None,
            }
        } else {
            err.source()
        };
    }
    None
}

fn tls_hint(e: &rustls::Error, access: &RedisAccess) -> String {
    use rustls::{AlertDescription as A, CertificateError as C};
    let ca = match &access.tls_files.ca {
        Some(path) => format!("redis_tls_ca_file (`{}`)", path.display()),
        None => "the system's roots (no redis_tls_ca_file is set)".to_owned(),
    };
    match e {
        rustls::Error::InvalidCertificate(
            C::NotValidForName | C::NotValidForNameContext { .. },
        ) => "the server's certificate does not name the host the gateway connects to (for a \
             Sentinel, the address it announces)"
            .to_owned(),
        rustls::Error::InvalidCertificate(C::Expired | C::ExpiredContext { .. }) => {
            "the server's certificate has expired".to_owned()
        }
        rustls::Error::InvalidCertificate(_) => {
            format!("the server's certificate does not verify against {ca}: set redis_tls_ca_file to the CA that signed it")
        }
        rustls::Error::AlertReceived(
            A::CertificateRequired
            | A::BadCertificate
            | A::UnknownCA
            | A::HandshakeFailure
            | A::CertificateUnknown
            | A::AccessDenied
            | A::DecryptError,
        ) => "the server refused this client's certificate, or wants one: check \
              redis_tls_cert_file and redis_tls_key_file"
            .to_owned(),
        rustls::Error::InvalidMessage(_) | rustls::Error::InappropriateMessage { .. } => {
            "the server does not speak TLS on this port (a `rediss://` URL needs Redis's tls-port)"
                .to_owned()
        }
        _ => format!("check redis_url's scheme and {ca}"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn access(url: &str) -> RedisAccess {
        RedisAccess::from_url(url).unwrap()
    }

    #[test]
    fn tls_failures_are_found_through_the_crates_wrappers_and_name_their_setting() {
        let unknown = rustls::Error::InvalidCertificate(rustls::CertificateError::UnknownIssuer);
        let wrapped = [
            redis::RedisError::from(unknown.clone()),
            redis::RedisError::from(std::io::Error::new(
                std::io::ErrorKind::InvalidData,
                unknown,
            )),
        ];
        for e in &wrapped {
            let sorted = classify(e, "Redis at h:1", &access("rediss://h:1/0"), Role::Data);
            let RedisAccessError::Tls { hint, .. } = &sorted else {
                panic!("not a TLS error: {sorted:?}")
            };
            assert!(hint.contains("redis_tls_ca_file"), "{hint}");
            assert!(sorted.is_fatal());
        }
        let alert = rustls::Error::AlertReceived(rustls::AlertDescription::CertificateRequired);
        let sorted = classify(
            &redis::RedisError::from(std::io::Error::other(alert)),
            "Redis at h:1",
            &access("rediss://h:1/0"),
            Role::Data,
        );
        assert!(
            sorted.to_string().contains("redis_tls_cert_file"),
            "{sorted}"
        );
    }

    #[test]
    fn refused_and_timed_out_connections_pass_and_wrong_passwords_do_not() {
        let refused =
            redis::RedisError::from(std::io::Error::from(std::io::ErrorKind::ConnectionRefused));
        let a = access("redis://gw:secret-pw@h:1/0");
        let sorted = classify(&refused, "Redis at h:1", &a, Role::Data);
        assert!(!sorted.is_fatal(), "{sorted}");
        let auth = redis::RedisError::from((
            redis::ErrorKind::AuthenticationFailed,
            "Password authentication failed",
        ));
        let sorted = classify(&auth, "Redis at h:1", &a, Role::Data);
        assert!(sorted.is_fatal());
        let text = sorted.to_string();
        assert!(
            text.contains("the password in redis_url") && text.contains("`gw`"),
            "{text}"
        );
        assert!(!text.contains("secret-pw"), "{text}");
        let sorted = classify(&auth, "Sentinel h:2", &a, Role::Sentinel);
        assert!(
            sorted
                .to_string()
                .contains("PET_GATEWAY_REDIS_SENTINEL_PASSWORD"),
            "{sorted}"
        );
    }
}
