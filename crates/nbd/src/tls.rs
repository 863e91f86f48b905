//! TLS credentials for the server and the client (X.509, PEM files, rustls
//! with the ring provider).
//!
//! Owns: loading certificates and keys, building rustls configurations, the
//! directory layout qemu and nbdkit use (`ca-cert.pem`, `server-cert.pem`,
//! `server-key.pem`, `client-cert.pem`, `client-key.pem`).
//! Must not: touch sockets. PSK is not offered: rustls has no external-PSK
//! support (see the crate documentation).

use std::path::{Path, PathBuf};
use std::sync::Arc;

use rustls::RootCertStore;
use rustls::server::WebPkiClientVerifier;
use rustls_pki_types::pem::PemObject;
use rustls_pki_types::{CertificateDer, PrivateKeyDer, ServerName};
use thiserror::Error;

/// Failure to load TLS credentials.
#[derive(Debug, Error)]
pub enum TlsConfigError {
    #[error("cannot read {path}: {reason}")]
    File { path: PathBuf, reason: String },
    #[error("no certificate found in {0}")]
    NoCertificate(PathBuf),
    #[error("invalid TLS configuration: {0}")]
    Rustls(#[from] rustls::Error),
    #[error("invalid client certificate verifier: {0}")]
    Verifier(String),
    #[error("invalid TLS server name {0:?}")]
    ServerName(String),
}

fn provider() -> Arc<rustls::crypto::CryptoProvider> {
    Arc::new(rustls::crypto::ring::default_provider())
}

fn load_certs(path: &Path) -> Result<Vec<CertificateDer<'static>>, TlsConfigError> {
    let iter = CertificateDer::pem_file_iter(path).map_err(|e| TlsConfigError::File {
        path: path.to_path_buf(),
        reason: e.to_string(),
    })?;
    let certs: Vec<_> = iter
        .collect::<Result<_, _>>()
        .map_err(|e| TlsConfigError::File {
            path: path.to_path_buf(),
            reason: e.to_string(),
        })?;
    if certs.is_empty() {
        return Err(TlsConfigError::NoCertificate(path.to_path_buf()));
    }
    Ok(certs)
}

fn load_key(path: &Path) -> Result<PrivateKeyDer<'static>, TlsConfigError> {
    PrivateKeyDer::from_pem_file(path).map_err(|e| TlsConfigError::File {
        path: path.to_path_buf(),
        reason: e.to_string(),
    })
}

fn load_roots(path: &Path) -> Result<RootCertStore, TlsConfigError> {
    let mut roots = RootCertStore::empty();
    for c in load_certs(path)? {
        roots.add(c)?;
    }
    Ok(roots)
}

/// Server-side TLS credentials. A server given these runs in FORCEDTLS mode.
#[derive(Clone)]
pub struct TlsServerConfig {
    pub(crate) config: Arc<rustls::ServerConfig>,
}

impl std::fmt::Debug for TlsServerConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("TlsServerConfig")
    }
}

impl TlsServerConfig {
    /// Certificate chain and private key from PEM files; when `client_ca`
    /// is given, clients must present a certificate signed by it.
    pub fn from_pem_files(
        cert: &Path,
        key: &Path,
        client_ca: Option<&Path>,
    ) -> Result<Self, TlsConfigError> {
        let certs = load_certs(cert)?;
        let key = load_key(key)?;
        let builder = rustls::ServerConfig::builder_with_provider(provider())
            .with_safe_default_protocol_versions()?;
        let config = match client_ca {
            None => builder.with_no_client_auth().with_single_cert(certs, key)?,
            Some(ca) => {
                let roots = Arc::new(load_roots(ca)?);
                let verifier = WebPkiClientVerifier::builder_with_provider(roots, provider())
                    .build()
                    .map_err(|e| TlsConfigError::Verifier(e.to_string()))?;
                builder
                    .with_client_cert_verifier(verifier)
                    .with_single_cert(certs, key)?
            }
        };
        Ok(TlsServerConfig {
            config: Arc::new(config),
        })
    }

    /// The qemu/nbdkit directory layout: `server-cert.pem`, `server-key.pem`,
    /// and with `verify_peer`, `ca-cert.pem` to check client certificates.
    pub fn from_x509_dir(dir: &Path, verify_peer: bool) -> Result<Self, TlsConfigError> {
        let ca = dir.join("ca-cert.pem");
        Self::from_pem_files(
            &dir.join("server-cert.pem"),
            &dir.join("server-key.pem"),
            verify_peer.then_some(ca.as_path()),
        )
    }

    /// Wraps a ready rustls configuration.
    pub fn from_rustls(config: Arc<rustls::ServerConfig>) -> Self {
        TlsServerConfig { config }
    }
}

/// Client-side TLS credentials.
#[derive(Clone)]
pub struct TlsClientConfig {
    pub(crate) config: Arc<rustls::ClientConfig>,
}

impl std::fmt::Debug for TlsClientConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("TlsClientConfig")
    }
}

impl TlsClientConfig {
    /// Trusts the CAs in `ca`; presents `client` (certificate, key) if given.
    pub fn from_pem_files(
        ca: &Path,
        client: Option<(&Path, &Path)>,
    ) -> Result<Self, TlsConfigError> {
        let roots = load_roots(ca)?;
        let builder = rustls::ClientConfig::builder_with_provider(provider())
            .with_safe_default_protocol_versions()?
            .with_root_certificates(roots);
        let config = match client {
            None => builder.with_no_client_auth(),
            Some((cert, key)) => {
                builder.with_client_auth_cert(load_certs(cert)?, load_key(key)?)?
            }
        };
        Ok(TlsClientConfig {
            config: Arc::new(config),
        })
    }

    /// The qemu/libnbd directory layout: `ca-cert.pem`, and when both exist,
    /// `client-cert.pem` and `client-key.pem`.
    pub fn from_x509_dir(dir: &Path) -> Result<Self, TlsConfigError> {
        let cert = dir.join("client-cert.pem");
        let key = dir.join("client-key.pem");
        let client = (cert.exists() && key.exists()).then_some((cert.as_path(), key.as_path()));
        Self::from_pem_files(&dir.join("ca-cert.pem"), client)
    }

    /// Wraps a ready rustls configuration.
    pub fn from_rustls(config: Arc<rustls::ClientConfig>) -> Self {
        TlsClientConfig { config }
    }

    pub(crate) fn connection(
        &self,
        server_name: &str,
    ) -> Result<rustls::Connection, TlsConfigError> {
        let name = ServerName::try_from(server_name.to_string())
            .map_err(|_| TlsConfigError::ServerName(server_name.to_string()))?;
        Ok(rustls::Connection::Client(rustls::ClientConnection::new(
            self.config.clone(),
            name,
        )?))
    }
}
