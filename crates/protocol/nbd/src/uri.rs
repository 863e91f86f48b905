//! NBD URIs as qemu and libnbd write them:
//! `nbd://HOST[:PORT]/EXPORT`, `nbd+unix:///EXPORT?socket=PATH`, and the
//! TLS forms `nbds://` / `nbds+unix://` (with `tls-certificates=DIR`, or
//! `tls-psk-file=FILE` and the user as `nbds://USER@HOST/`, and the
//! non-standard `tls-hostname=NAME`).
//!
//! Owns: parsing and printing. Must not: connect or resolve anything.

use std::fmt;
use std::path::PathBuf;
use std::str::FromStr;

use thiserror::Error;

/// Default NBD TCP port.
pub const DEFAULT_PORT: u16 = 10809;

/// A malformed URI.
#[derive(Debug, Clone, Error, PartialEq, Eq)]
#[error("invalid NBD URI {uri:?}: {reason}")]
pub struct UriError {
    pub uri: String,
    pub reason: String,
}

/// Where the server listens.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Transport {
    Unix(PathBuf),
    Tcp { host: String, port: u16 },
}

/// A parsed NBD URI.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NbdUri {
    pub transport: Transport,
    /// Export name; empty for the default export.
    pub export: String,
    /// `nbds` schemes: TLS required.
    pub tls: bool,
    /// Directory with `ca-cert.pem` (and optionally client-cert/key).
    pub tls_certificates: Option<PathBuf>,
    /// `username:hexkey` file for TLS-PSK.
    pub tls_psk_file: Option<PathBuf>,
    /// The user part of the authority (`USER@`): the TLS-PSK identity.
    pub user: Option<String>,
    /// Name to verify the server certificate against (default: the TCP
    /// host, or `localhost` for Unix sockets).
    pub tls_hostname: Option<String>,
}

fn percent_decode(s: &str) -> Option<String> {
    let b = s.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        if b[i] == b'%' {
            let hex = s.get(i + 1..i + 3)?;
            out.push(u8::from_str_radix(hex, 16).ok()?);
            i += 3;
        } else {
            out.push(b[i]);
            i += 1;
        }
    }
    String::from_utf8(out).ok()
}

fn percent_encode(s: &str, keep: &[u8]) -> String {
    let mut out = String::with_capacity(s.len());
    for &c in s.as_bytes() {
        if c.is_ascii_alphanumeric() || b"-._~".contains(&c) || keep.contains(&c) {
            out.push(c as char);
        } else {
            out.push_str(&format!("%{c:02X}"));
        }
    }
    out
}

impl NbdUri {
    pub fn parse(uri: &str) -> Result<NbdUri, UriError> {
        let err = |reason: &str| UriError {
            uri: uri.to_string(),
            reason: reason.to_string(),
        };
        let (scheme, rest) = uri.split_once("://").ok_or_else(|| err("missing scheme"))?;
        let (tls, unix) = match scheme.to_ascii_lowercase().as_str() {
            "nbd" | "nbd+tcp" => (false, false),
            "nbds" | "nbds+tcp" => (true, false),
            "nbd+unix" => (false, true),
            "nbds+unix" => (true, true),
            _ => return Err(err("scheme must be nbd, nbds, nbd+unix or nbds+unix")),
        };
        let (before_query, query) = match rest.split_once('?') {
            Some((a, q)) => (a, Some(q)),
            None => (rest, None),
        };
        let (authority, path) = match before_query.find('/') {
            Some(i) => (&before_query[..i], &before_query[i..]),
            None => (before_query, ""),
        };
        let (user, authority) = match authority.rsplit_once('@') {
            Some((u, a)) => (
                Some(percent_decode(u).ok_or_else(|| err("bad percent-encoding in the user"))?),
                a,
            ),
            None => (None, authority),
        };
        let export = percent_decode(path.strip_prefix('/').unwrap_or(path))
            .ok_or_else(|| err("bad percent-encoding in the export name"))?;
        let mut socket = None;
        let mut tls_certificates = None;
        let mut tls_psk_file = None;
        let mut tls_hostname = None;
        for pair in query
            .unwrap_or("")
            .split(['&', ';'])
            .filter(|p| !p.is_empty())
        {
            let (k, v) = pair.split_once('=').unwrap_or((pair, ""));
            let v = percent_decode(v).ok_or_else(|| err("bad percent-encoding in the query"))?;
            match k {
                "socket" => socket = Some(PathBuf::from(v)),
                "tls-certificates" => tls_certificates = Some(PathBuf::from(v)),
                "tls-psk-file" => tls_psk_file = Some(PathBuf::from(v)),
                "tls-hostname" => tls_hostname = Some(v),
                _ => {}
            }
        }
        let transport = if unix {
            if !authority.is_empty() && authority != "localhost" {
                return Err(err("a unix URI has no host"));
            }
            Transport::Unix(socket.ok_or_else(|| err("missing ?socket=PATH"))?)
        } else {
            if socket.is_some() {
                return Err(err("socket= needs the nbd+unix scheme"));
            }
            let (host, port) = if let Some(r) = authority.strip_prefix('[') {
                let (h, after) = r.split_once(']').ok_or_else(|| err("unclosed '['"))?;
                let port = match after.strip_prefix(':') {
                    Some(p) => Some(p),
                    None if after.is_empty() => None,
                    None => return Err(err("garbage after ']'")),
                };
                (h.to_string(), port)
            } else {
                match authority.rsplit_once(':') {
                    Some((h, p)) => (h.to_string(), Some(p)),
                    None => (authority.to_string(), None),
                }
            };
            if host.is_empty() {
                return Err(err("missing host"));
            }
            let port = match port {
                None | Some("") => DEFAULT_PORT,
                Some(p) => p.parse().map_err(|_| err("bad port"))?,
            };
            Transport::Tcp { host, port }
        };
        Ok(NbdUri {
            transport,
            export,
            tls,
            tls_certificates,
            tls_psk_file,
            user,
            tls_hostname,
        })
    }
}

impl FromStr for NbdUri {
    type Err = UriError;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        NbdUri::parse(s)
    }
}

impl fmt::Display for NbdUri {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let s = if self.tls { "nbds" } else { "nbd" };
        let export = percent_encode(&self.export, b"/");
        let user = self
            .user
            .as_ref()
            .map(|u| format!("{}@", percent_encode(u, b"")))
            .unwrap_or_default();
        let mut query: Vec<String> = Vec::new();
        match &self.transport {
            Transport::Unix(p) => {
                write!(f, "{s}+unix://{user}/{export}")?;
                query.push(format!(
                    "socket={}",
                    percent_encode(&p.to_string_lossy(), b"/")
                ));
            }
            Transport::Tcp { host, port } => {
                if host.contains(':') {
                    write!(f, "{s}://{user}[{host}]:{port}/{export}")?;
                } else {
                    write!(f, "{s}://{user}{host}:{port}/{export}")?;
                }
            }
        }
        if let Some(d) = &self.tls_certificates {
            query.push(format!(
                "tls-certificates={}",
                percent_encode(&d.to_string_lossy(), b"/")
            ));
        }
        if let Some(k) = &self.tls_psk_file {
            query.push(format!(
                "tls-psk-file={}",
                percent_encode(&k.to_string_lossy(), b"/")
            ));
        }
        if let Some(h) = &self.tls_hostname {
            query.push(format!("tls-hostname={}", percent_encode(h, b"")));
        }
        if !query.is_empty() {
            write!(f, "?{}", query.join("&"))?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_common_forms() {
        let u = NbdUri::parse("nbd+unix:///disk0?socket=/run/x.sock").unwrap();
        assert_eq!(u.transport, Transport::Unix("/run/x.sock".into()));
        assert_eq!(u.export, "disk0");
        assert!(!u.tls);
        let u = NbdUri::parse("nbd+unix:///?socket=/tmp/a%20b").unwrap();
        assert_eq!(u.export, "");
        assert_eq!(u.transport, Transport::Unix("/tmp/a b".into()));
        let u = NbdUri::parse("nbd://example.org:10810/a%2Fb").unwrap();
        assert_eq!(
            u.transport,
            Transport::Tcp {
                host: "example.org".into(),
                port: 10810
            }
        );
        assert_eq!(u.export, "a/b");
        let u = NbdUri::parse("nbd://[::1]/x").unwrap();
        assert_eq!(
            u.transport,
            Transport::Tcp {
                host: "::1".into(),
                port: DEFAULT_PORT
            }
        );
        let u = NbdUri::parse("nbds+unix:///e?socket=/s&tls-certificates=/pki").unwrap();
        assert!(u.tls);
        assert_eq!(u.tls_certificates, Some("/pki".into()));
        let again = NbdUri::parse(&u.to_string()).unwrap();
        assert_eq!(again, u);
        let u = NbdUri::parse("nbds+unix://alice@/e?socket=/s&tls-psk-file=/k.psk").unwrap();
        assert_eq!(u.user.as_deref(), Some("alice"));
        assert_eq!(u.tls_psk_file, Some("/k.psk".into()));
        assert_eq!(NbdUri::parse(&u.to_string()).unwrap(), u);
        let u = NbdUri::parse("nbds://bob@h:1/e").unwrap();
        assert_eq!(u.user.as_deref(), Some("bob"));
        assert_eq!(
            u.transport,
            Transport::Tcp {
                host: "h".into(),
                port: 1
            }
        );
        assert_eq!(NbdUri::parse(&u.to_string()).unwrap(), u);
    }

    #[test]
    fn rejects_bad_uris() {
        for bad in [
            "nbd+unix:///x",
            "http://x/y",
            "nbd:///x",
            "nbd://h:notaport/x",
            "nbd://h/x?socket=/s",
            "nbd://h/%zz",
            "noscheme",
        ] {
            assert!(NbdUri::parse(bad).is_err(), "{bad} accepted");
        }
    }
}
