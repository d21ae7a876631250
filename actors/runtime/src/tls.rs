//! TLS material for the gateway's HTTPS and for NATS.
//!
//! - [`server_config`]: a certificate chain and key (PEM files) read into a
//!   rustls server config, every failure naming the file.
//! - [`Pki::generate`]: a throwaway certificate authority and one server
//!   certificate signed by it, made at start by a node that runs NATS
//!   itself (and by tests). The CA's key is never written anywhere: once the
//!   server certificate is signed, nothing can issue another.
//!
//! Invariant: every file holding a private key is written mode 0600.

use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use thiserror::Error;

#[derive(Debug, Error)]
pub enum TlsError {
    #[error("TLS certificate file {path}: {reason}")]
    Cert { path: String, reason: String },
    #[error("TLS key file {path}: {reason}")]
    Key { path: String, reason: String },
    #[error("TLS certificate {cert} and key {key} do not make a server config: {reason}")]
    Config {
        cert: String,
        key: String,
        reason: String,
    },
    #[error("cannot generate TLS certificates: {0}")]
    Generate(String),
    #[error("cannot write {path}: {cause}")]
    Write { path: String, cause: std::io::Error },
}

/// Reads every certificate of a PEM file (at least one).
pub fn read_certs(path: &Path) -> Result<Vec<CertificateDer<'static>>, TlsError> {
    let err = |reason: String| TlsError::Cert {
        path: path.display().to_string(),
        reason,
    };
    let certs = CertificateDer::pem_file_iter(path)
        .map_err(|e| err(e.to_string()))?
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| err(e.to_string()))?;
    if certs.is_empty() {
        return Err(err("holds no PEM certificate".into()));
    }
    Ok(certs)
}

/// A server config (TLS 1.2 and 1.3, HTTP/1.1 by ALPN) from a PEM chain and
/// its PEM private key (PKCS#8, PKCS#1 or SEC1).
pub fn server_config(cert: &Path, key: &Path) -> Result<Arc<rustls::ServerConfig>, TlsError> {
    let chain = read_certs(cert)?;
    let key_der = PrivateKeyDer::from_pem_file(key).map_err(|e| TlsError::Key {
        path: key.display().to_string(),
        reason: e.to_string(),
    })?;
    let mut cfg = rustls::ServerConfig::builder_with_provider(Arc::new(
        rustls::crypto::ring::default_provider(),
    ))
    .with_safe_default_protocol_versions()
    .and_then(|b| b.with_no_client_auth().with_single_cert(chain, key_der))
    .map_err(|e| TlsError::Config {
        cert: cert.display().to_string(),
        key: key.display().to_string(),
        reason: e.to_string(),
    })?;
    cfg.alpn_protocols = vec![b"http/1.1".to_vec()];
    Ok(Arc::new(cfg))
}

/// A client config trusting only the CAs of a PEM file.
pub fn client_config(ca: &Path) -> Result<Arc<rustls::ClientConfig>, TlsError> {
    let mut roots = rustls::RootCertStore::empty();
    for c in read_certs(ca)? {
        roots.add(c).map_err(|e| TlsError::Cert {
            path: ca.display().to_string(),
            reason: e.to_string(),
        })?;
    }
    let cfg = rustls::ClientConfig::builder_with_provider(Arc::new(
        rustls::crypto::ring::default_provider(),
    ))
    .with_safe_default_protocol_versions()
    .map_err(|e| TlsError::Generate(e.to_string()))?
    .with_root_certificates(roots)
    .with_no_client_auth();
    Ok(Arc::new(cfg))
}

/// A CA certificate and a server certificate it signed, in PEM.
pub struct Pki {
    /// The CA certificate clients trust.
    pub ca_pem: String,
    /// The server's certificate.
    pub cert_pem: String,
    /// The server's private key (secret).
    pub key_pem: String,
}

impl std::fmt::Debug for Pki {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Pki").finish_non_exhaustive()
    }
}

/// Where [`Pki::write`] put the files.
#[derive(Clone, Debug)]
pub struct PkiFiles {
    pub ca: PathBuf,
    pub cert: PathBuf,
    pub key: PathBuf,
}

impl Pki {
    /// A fresh CA (`org` names it) and a server certificate for `names`
    /// (DNS names or IP addresses), both ECDSA P-256.
    pub fn generate(org: &str, names: &[&str]) -> Result<Pki, TlsError> {
        let g = |e: rcgen::Error| TlsError::Generate(e.to_string());
        let ca_key = rcgen::KeyPair::generate().map_err(g)?;
        let mut ca = rcgen::CertificateParams::new(Vec::<String>::new()).map_err(g)?;
        ca.is_ca = rcgen::IsCa::Ca(rcgen::BasicConstraints::Constrained(0));
        ca.distinguished_name
            .push(rcgen::DnType::CommonName, format!("{org} CA"));
        ca.key_usages = vec![
            rcgen::KeyUsagePurpose::KeyCertSign,
            rcgen::KeyUsagePurpose::CrlSign,
        ];
        let ca_cert = ca.self_signed(&ca_key).map_err(g)?;
        let issuer = rcgen::Issuer::new(ca, ca_key);

        let key = rcgen::KeyPair::generate().map_err(g)?;
        let mut leaf =
            rcgen::CertificateParams::new(names.iter().map(|n| n.to_string()).collect::<Vec<_>>())
                .map_err(g)?;
        leaf.distinguished_name
            .push(rcgen::DnType::CommonName, org.to_string());
        leaf.extended_key_usages = vec![
            rcgen::ExtendedKeyUsagePurpose::ServerAuth,
            rcgen::ExtendedKeyUsagePurpose::ClientAuth,
        ];
        let cert = leaf.signed_by(&key, &issuer).map_err(g)?;
        Ok(Pki {
            ca_pem: ca_cert.pem(),
            cert_pem: cert.pem(),
            key_pem: key.serialize_pem(),
        })
    }

    /// Writes `ca.pem`, `cert.pem` and `key.pem` (0600) into `dir`.
    pub fn write(&self, dir: &Path) -> Result<PkiFiles, TlsError> {
        let files = PkiFiles {
            ca: dir.join("ca.pem"),
            cert: dir.join("cert.pem"),
            key: dir.join("key.pem"),
        };
        write_file(&files.ca, &self.ca_pem, false)?;
        write_file(&files.cert, &self.cert_pem, false)?;
        write_file(&files.key, &self.key_pem, true)?;
        Ok(files)
    }
}

/// Writes a file, owner-only (0600) when it is `secret`; a secret file is
/// created with that mode, never widened then narrowed.
pub fn write_file(path: &Path, text: &str, secret: bool) -> Result<(), TlsError> {
    use std::io::Write;
    use std::os::unix::fs::OpenOptionsExt;
    let werr = |source| TlsError::Write {
        path: path.display().to_string(),
        cause: source,
    };
    let mut opts = std::fs::OpenOptions::new();
    opts.write(true).create(true).truncate(true);
    if secret {
        opts.mode(0o600);
    }
    let mut f = opts.open(path).map_err(werr)?;
    if secret {
        use std::os::unix::fs::PermissionsExt;
        f.set_permissions(std::fs::Permissions::from_mode(0o600))
            .map_err(werr)?;
    }
    f.write_all(text.as_bytes()).map_err(werr)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A generated certificate serves a TLS handshake that a client trusting
    /// the generated CA completes, and one trusting another CA refuses.
    #[tokio::test]
    async fn generated_certificates_complete_a_handshake() {
        let dir = tempfile::tempdir().unwrap();
        let pki = Pki::generate("test", &["localhost", "127.0.0.1"]).unwrap();
        let files = pki.write(dir.path()).unwrap();
        use std::os::unix::fs::PermissionsExt;
        let mode = std::fs::metadata(&files.key).unwrap().permissions().mode();
        assert_eq!(mode & 0o777, 0o600, "the key is owner-only");

        let server = server_config(&files.cert, &files.key).unwrap();
        let acceptor = tokio_rustls::TlsAcceptor::from(server);
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let mut serve = tokio::task::JoinSet::new();
        serve.spawn(async move {
            for _ in 0..2 {
                let (tcp, _) = listener.accept().await.unwrap();
                let _ = acceptor.accept(tcp).await;
            }
        });
        let name = rustls::pki_types::ServerName::try_from("127.0.0.1").unwrap();

        let ok = tokio_rustls::TlsConnector::from(client_config(&files.ca).unwrap());
        let tcp = tokio::net::TcpStream::connect(addr).await.unwrap();
        ok.connect(name.clone(), tcp)
            .await
            .expect("a client trusting the CA connects");

        let other_dir = tempfile::tempdir().unwrap();
        let other = Pki::generate("other", &["127.0.0.1"])
            .unwrap()
            .write(other_dir.path())
            .unwrap();
        let bad = tokio_rustls::TlsConnector::from(client_config(&other.ca).unwrap());
        let tcp = tokio::net::TcpStream::connect(addr).await.unwrap();
        let err = bad.connect(name, tcp).await.unwrap_err();
        assert!(
            err.to_string().contains("UnknownIssuer") || err.to_string().contains("issuer"),
            "{err}"
        );
        serve.join_next().await.unwrap().unwrap();
    }

    #[test]
    fn bad_files_name_the_file() {
        let dir = tempfile::tempdir().unwrap();
        let empty = dir.path().join("empty.pem");
        std::fs::write(&empty, "").unwrap();
        let e = server_config(&empty, &empty).unwrap_err().to_string();
        assert!(
            e.contains("empty.pem") && e.contains("no PEM certificate"),
            "{e}"
        );
        let missing = dir.path().join("missing.pem");
        let e = read_certs(&missing).unwrap_err().to_string();
        assert!(e.contains("missing.pem"), "{e}");
        let pki = Pki::generate("t", &["localhost"]).unwrap();
        let files = pki.write(dir.path()).unwrap();
        let e = server_config(&files.cert, &empty).unwrap_err().to_string();
        assert!(e.contains("TLS key file") && e.contains("empty.pem"), "{e}");
    }
}
