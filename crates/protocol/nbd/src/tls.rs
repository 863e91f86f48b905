//! TLS credentials for the server and the client: X.509 certificates (PEM
//! files, rustls with the ring provider) and pre-shared keys (the
//! `username:hexkey` files of qemu and nbdkit, OpenSSL, because rustls has
//! no external PSK).
//!
//! Owns: loading certificates and keys, building the engines'
//! configurations, the directory layout qemu and nbdkit use (`ca-cert.pem`,
//! `server-cert.pem`, `server-key.pem`, `client-cert.pem`,
//! `client-key.pem`, `keys.psk`).
//! Must not: touch sockets.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use rustls::RootCertStore;
use rustls::server::WebPkiClientVerifier;
use rustls_pki_types::pem::PemObject;
use rustls_pki_types::{CertificateDer, PrivateKeyDer, ServerName};
use thiserror::Error;

use crate::psk::PskKeys;
use crate::tls_session::{MemPipe, TlsSession};

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
    #[error("{path} line {line}: {reason}")]
    PskFile {
        path: PathBuf,
        line: usize,
        reason: String,
    },
    #[error("no pre-shared key in {0}")]
    NoPsk(PathBuf),
    #[error("no pre-shared key for user {user:?} in {path}")]
    NoPskUser { path: PathBuf, user: String },
    #[error("OpenSSL: {0}")]
    OpenSsl(#[from] openssl::error::ErrorStack),
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
    creds: ServerCreds,
}

#[derive(Clone)]
enum ServerCreds {
    X509(Arc<rustls::ServerConfig>),
    Psk(openssl::ssl::SslContext),
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
        Ok(Self::from_rustls(Arc::new(config)))
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
        TlsServerConfig {
            creds: ServerCreds::X509(config),
        }
    }

    /// Pre-shared keys from a `username:hexkey` file (qemu's `keys.psk`,
    /// nbdkit's `--tls-psk`): a client must prove it holds the key of the
    /// user it names.
    pub fn from_psk_file(path: &Path) -> Result<Self, TlsConfigError> {
        Self::from_psk_keys(PskKeys::load(path)?)
    }

    pub fn from_psk_keys(keys: PskKeys) -> Result<Self, TlsConfigError> {
        Ok(TlsServerConfig {
            creds: ServerCreds::Psk(crate::psk::server_context(keys)?),
        })
    }

    pub fn session(&self) -> Result<TlsSession, TlsConfigError> {
        Ok(match &self.creds {
            ServerCreds::X509(config) => {
                let conn = rustls::ServerConnection::new(config.clone())?;
                TlsSession::Rustls(Box::new(conn.into()))
            }
            ServerCreds::Psk(ctx) => openssl_session(ctx, false)?,
        })
    }
}

fn openssl_session(
    ctx: &openssl::ssl::SslContext,
    connect: bool,
) -> Result<TlsSession, TlsConfigError> {
    let mut ssl = openssl::ssl::Ssl::new(ctx)?;
    if connect {
        ssl.set_connect_state();
    } else {
        ssl.set_accept_state();
    }
    let stream = openssl::ssl::SslStream::new(ssl, MemPipe::default())?;
    Ok(TlsSession::OpenSsl(Box::new(stream)))
}

/// Client-side TLS credentials.
#[derive(Clone)]
pub struct TlsClientConfig {
    creds: ClientCreds,
}

#[derive(Clone)]
enum ClientCreds {
    X509(Arc<rustls::ClientConfig>),
    Psk(openssl::ssl::SslContext),
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
        Ok(Self::from_rustls(Arc::new(config)))
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
        TlsClientConfig {
            creds: ClientCreds::X509(config),
        }
    }

    /// The key of `user` from a `username:hexkey` file (libnbd's
    /// `tls-psk-file`, qemu's `keys.psk`).
    pub fn from_psk_file(path: &Path, user: &str) -> Result<Self, TlsConfigError> {
        let keys = PskKeys::load(path)?;
        let key = keys.get(user).ok_or_else(|| TlsConfigError::NoPskUser {
            path: path.to_path_buf(),
            user: user.to_string(),
        })?;
        Ok(TlsClientConfig {
            creds: ClientCreds::Psk(crate::psk::client_context(user, key)?),
        })
    }

    pub fn session(&self, server_name: &str) -> Result<TlsSession, TlsConfigError> {
        Ok(match &self.creds {
            ClientCreds::X509(config) => {
                let name = ServerName::try_from(server_name.to_string())
                    .map_err(|_| TlsConfigError::ServerName(server_name.to_string()))?;
                let conn = rustls::ClientConnection::new(config.clone(), name)?;
                TlsSession::Rustls(Box::new(conn.into()))
            }
            ClientCreds::Psk(ctx) => openssl_session(ctx, true)?,
        })
    }
}
