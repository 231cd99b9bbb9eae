//! Certificates for the TLS tests, and a client that trusts only them.

use std::path::Path;

/// A throw-away certificate authority and a server certificate it signed for `localhost` and
/// `127.0.0.1`, written as PEM files.
pub struct TestCert {
    pub ca_der: Vec<u8>,
    pub cert_pem: String,
    pub key_pem: String,
}

impl TestCert {
    pub fn generate(ca_name: &str) -> TestCert {
        use rcgen::{BasicConstraints, CertificateParams, DnType, IsCa, Issuer, KeyPair, SanType};
        let ca_key = KeyPair::generate().expect("CA key");
        let mut ca = CertificateParams::new(Vec::<String>::new()).expect("CA params");
        ca.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        ca.distinguished_name.push(DnType::CommonName, ca_name);
        let ca_cert = ca.self_signed(&ca_key).expect("CA certificate");
        let key = KeyPair::generate().expect("server key");
        let mut params = CertificateParams::new(vec!["localhost".to_owned()]).expect("params");
        params
            .subject_alt_names
            .push(SanType::IpAddress(std::net::IpAddr::from([127, 0, 0, 1])));
        let cert = params
            .signed_by(&key, &Issuer::from_params(&ca, &ca_key))
            .expect("server certificate");
        TestCert {
            ca_der: ca_cert.der().to_vec(),
            cert_pem: cert.pem(),
            key_pem: key.serialize_pem(),
        }
    }

    pub fn write(&self, cert: &Path, key: &Path) {
        std::fs::write(cert, &self.cert_pem).expect("write certificate");
        std::fs::write(key, &self.key_pem).expect("write key");
    }

    /// An HTTPS client that trusts only this CA and offers only `alpn` (b"h2", b"http/1.1").
    pub fn client(&self, alpn: &[&[u8]]) -> reqwest::Client {
        let _ = rustls::crypto::ring::default_provider().install_default();
        let mut roots = rustls::RootCertStore::empty();
        roots
            .add(rustls::pki_types::CertificateDer::from(self.ca_der.clone()))
            .expect("trust the test CA");
        let mut tls = rustls::ClientConfig::builder()
            .with_root_certificates(roots)
            .with_no_client_auth();
        tls.alpn_protocols = alpn.iter().map(|p| p.to_vec()).collect();
        reqwest::Client::builder()
            .tls_backend_preconfigured(tls)
            .build()
            .expect("https client")
    }
}
