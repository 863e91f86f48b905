//! TLS pre-shared keys: the `username:hexkey` files of qemu (`keys.psk` in
//! a `tls-creds-psk` directory), nbdkit (`--tls-psk=FILE`) and libnbd
//! (`tls-psk-file=FILE`), and the OpenSSL contexts that use them (TLS 1.3
//! external PSK, or the TLS 1.2 (EC)DHE-PSK and PSK suites).
//!
//! Owns: parsing and checking key files, answering OpenSSL's key lookups.
//! Must not: log or print key material.

use std::collections::HashMap;
use std::path::Path;

use openssl::error::ErrorStack;
use openssl::ssl::{SslContext, SslMethod, SslVersion};
use tracing::warn;

use crate::tls::TlsConfigError;

/// OpenSSL's limits (`PSK_MAX_IDENTITY_LEN`, `PSK_MAX_PSK_LEN`) are larger;
/// these keep every key usable by every peer.
const MAX_USER_LEN: usize = 128;
const MAX_KEY_LEN: usize = 256;

/// Only suites that authenticate with the key; ECDHE first for forward secrecy.
const TLS12_PSK_CIPHERS: &str = "ECDHEPSK:DHEPSK:PSK:!aNULL:!eNULL";

/// Keys by user name.
#[derive(Clone, Default)]
pub struct PskKeys {
    keys: HashMap<String, Vec<u8>>,
}

impl std::fmt::Debug for PskKeys {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // Names only: the keys are secrets.
        f.debug_struct("PskKeys")
            .field("users", &self.keys.keys().collect::<Vec<_>>())
            .finish()
    }
}

impl PskKeys {
    /// Reads a key file; every malformed line is reported with its number.
    pub fn load(path: &Path) -> Result<Self, TlsConfigError> {
        let text = std::fs::read_to_string(path).map_err(|e| TlsConfigError::File {
            path: path.to_path_buf(),
            reason: e.to_string(),
        })?;
        let keys = Self::parse(&text).map_err(|(line, reason)| TlsConfigError::PskFile {
            path: path.to_path_buf(),
            line,
            reason,
        })?;
        if keys.keys.is_empty() {
            return Err(TlsConfigError::NoPsk(path.to_path_buf()));
        }
        Ok(keys)
    }

    /// Parses `username:hexkey` lines (blank lines are skipped).
    pub fn parse(text: &str) -> Result<Self, (usize, String)> {
        let mut keys = HashMap::new();
        for (i, line) in text.lines().enumerate() {
            let line = line.trim();
            if line.is_empty() {
                continue;
            }
            let n = i + 1;
            let (user, hex) = line
                .split_once(':')
                .ok_or((n, "expected username:hexkey".to_string()))?;
            if user.is_empty() || user.len() > MAX_USER_LEN {
                return Err((n, format!("user name must be 1 to {MAX_USER_LEN} bytes")));
            }
            let key = decode_hex(hex).map_err(|r| (n, r))?;
            if key.is_empty() || key.len() > MAX_KEY_LEN {
                return Err((n, format!("key must be 1 to {MAX_KEY_LEN} bytes")));
            }
            if keys.insert(user.to_string(), key).is_some() {
                return Err((n, format!("user {user:?} appears twice")));
            }
        }
        Ok(PskKeys { keys })
    }

    /// The key of `user`.
    pub fn get(&self, user: &str) -> Option<&[u8]> {
        self.keys.get(user).map(Vec::as_slice)
    }
}

fn decode_hex(hex: &str) -> Result<Vec<u8>, String> {
    if !hex.len().is_multiple_of(2) {
        return Err("key has an odd number of hex digits".to_string());
    }
    (0..hex.len())
        .step_by(2)
        .map(|i| {
            hex.get(i..i + 2)
                .and_then(|d| u8::from_str_radix(d, 16).ok())
                .ok_or_else(|| format!("key is not hexadecimal at character {}", i + 1))
        })
        .collect()
}

fn base_context(method: SslMethod) -> Result<openssl::ssl::SslContextBuilder, ErrorStack> {
    let mut b = SslContext::builder(method)?;
    b.set_min_proto_version(Some(SslVersion::TLS1_2))?;
    b.set_cipher_list(TLS12_PSK_CIPHERS)?;
    Ok(b)
}

/// A server context that accepts any user in `keys` holding its key.
pub(crate) fn server_context(keys: PskKeys) -> Result<SslContext, ErrorStack> {
    let mut b = base_context(SslMethod::tls_server())?;
    // Resumption tickets would be a second way in that outlives the key file.
    b.set_num_tickets(0)?;
    b.set_psk_server_callback(move |_ssl, identity, out| {
        let user = identity.and_then(|i| std::str::from_utf8(i).ok());
        match user.and_then(|u| keys.get(u)) {
            Some(key) if key.len() <= out.len() => {
                out[..key.len()].copy_from_slice(key);
                Ok(key.len())
            }
            _ => {
                warn!(
                    user = user.unwrap_or("<not UTF-8>"),
                    "TLS-PSK: unknown user"
                );
                // Zero length: OpenSSL refuses the handshake.
                Ok(0)
            }
        }
    });
    Ok(b.build())
}

/// A client context that logs in as `user` with `key`.
pub(crate) fn client_context(user: &str, key: &[u8]) -> Result<SslContext, ErrorStack> {
    let mut b = base_context(SslMethod::tls_client())?;
    let user = user.as_bytes().to_vec();
    let key = key.to_vec();
    b.set_psk_client_callback(move |_ssl, _hint, identity_out, psk_out| {
        // The identity is a C string: it needs room for its NUL.
        if user.len() >= identity_out.len() || key.len() > psk_out.len() {
            return Ok(0);
        }
        identity_out[..user.len()].copy_from_slice(&user);
        identity_out[user.len()] = 0;
        psk_out[..key.len()].copy_from_slice(&key);
        Ok(key.len())
    });
    Ok(b.build())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_qemu_key_files() {
        let k = PskKeys::parse("alice:0102ff\n\nbob:AbCd\n").unwrap();
        assert_eq!(k.get("alice"), Some(&[1u8, 2, 0xff][..]));
        assert_eq!(k.get("bob"), Some(&[0xab, 0xcd][..]));
        assert_eq!(k.get("carol"), None);
    }

    #[test]
    fn malformed_lines_are_named() {
        for (text, line, what) in [
            ("alice", 1, "username:hexkey"),
            ("a:01\nb:0g", 2, "not hexadecimal"),
            ("a:012", 1, "odd number"),
            ("a:01\na:02", 2, "twice"),
            (":01", 1, "user name"),
            ("a:", 1, "key must be"),
        ] {
            let (n, reason) = PskKeys::parse(text).unwrap_err();
            assert_eq!(n, line, "{text:?}");
            assert!(reason.contains(what), "{text:?}: {reason}");
        }
    }

    #[test]
    fn empty_file_is_refused() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("keys.psk");
        std::fs::write(&p, "\n").unwrap();
        assert!(matches!(PskKeys::load(&p), Err(TlsConfigError::NoPsk(_))));
        std::fs::write(&p, "x:zz\n").unwrap();
        let e = PskKeys::load(&p).unwrap_err().to_string();
        assert!(e.contains("line 1"), "{e}");
        assert!(!e.contains("zz"), "key material must not be echoed: {e}");
    }
}
