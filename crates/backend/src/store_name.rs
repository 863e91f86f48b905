//! Store names: what an image names its file or its backing file with. A
//! name is either an NBD URI (a store on an export of a storage server) or
//! a local path; this module alone tells them apart, so the COW layer
//! resolves and opens backing names without knowing any URI syntax.
//!
//! Owns: the URI-or-path decision, the resolution of a backing name
//! relative to the name of the image that holds it, and whether two URIs
//! name exports of one storage server.
//! Must not: open, connect or touch the file system.

use std::path::Path;

use vdcache_nbd_proto::NbdUri;

/// What a store name names.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StoreName<'a> {
    /// An export of an NBD server (`nbd://`, `nbd+unix://`, `nbds://`,
    /// `nbds+unix://`).
    Nbd(&'a str),
    /// A local file.
    Path(&'a Path),
}

impl<'a> StoreName<'a> {
    /// Tells a URI from a path; anything that is not an NBD URI is a path.
    pub fn of(name: &'a str) -> StoreName<'a> {
        if is_nbd_uri(name) {
            StoreName::Nbd(name)
        } else {
            StoreName::Path(Path::new(name))
        }
    }
}

/// Whether a name is an NBD URI rather than a path.
pub fn is_nbd_uri(name: &str) -> bool {
    ["nbd://", "nbd+unix://", "nbds://", "nbds+unix://"]
        .iter()
        .any(|s| name.starts_with(s))
}

/// The store a backing name found in `parent`'s header refers to: an
/// absolute path or a URI as it stands; a relative name beside `parent`
/// (in its directory, or its directory of export names).
pub fn resolve_backing_name(parent: &str, backing: &str) -> String {
    let b = Path::new(backing);
    if b.is_absolute() || is_nbd_uri(backing) {
        return backing.to_string();
    }
    if is_nbd_uri(parent) {
        return resolve_in_uri(parent, backing);
    }
    let dir = Path::new(parent)
        .parent()
        .map(Path::to_path_buf)
        .unwrap_or_default();
    dir.join(b).display().to_string()
}

/// Whether two NBD URIs name exports of the same storage server (the same
/// Unix socket, or the same host and port); false when either is not a
/// valid NBD URI.
pub fn same_server(a: &str, b: &str) -> bool {
    match (NbdUri::parse(a), NbdUri::parse(b)) {
        (Ok(a), Ok(b)) => a.transport == b.transport,
        _ => false,
    }
}

/// A backing name relative to an image on an NBD export names another
/// export of the same server, in the same directory of export names (as
/// nbdkit's file plugin exports a directory).
fn resolve_in_uri(parent: &str, backing: &str) -> String {
    match NbdUri::parse(parent) {
        Ok(mut uri) => {
            let dir = uri
                .export
                .rfind('/')
                .map_or("", |i| &uri.export[..=i])
                .to_string();
            uri.export = format!("{dir}{backing}");
            uri.to_string()
        }
        Err(_) => backing.to_string(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tells_uris_from_paths() {
        for uri in [
            "nbd://h/x",
            "nbd+unix:///x?socket=/s",
            "nbds://h:10809/x",
            "nbds+unix:///x?socket=/s",
        ] {
            assert_eq!(StoreName::of(uri), StoreName::Nbd(uri));
        }
        for path in ["disk.qcow2", "/a/nbd://x", "nbd:/x", "./nbd+unix"] {
            assert_eq!(StoreName::of(path), StoreName::Path(Path::new(path)));
        }
    }

    #[test]
    fn resolves_backing_names_beside_their_parent() {
        assert_eq!(
            resolve_backing_name("/d/top.qcow2", "base.qcow2"),
            "/d/base.qcow2"
        );
        assert_eq!(
            resolve_backing_name("top.qcow2", "base.qcow2"),
            "base.qcow2"
        );
        assert_eq!(
            resolve_backing_name("/d/top.qcow2", "/e/base.qcow2"),
            "/e/base.qcow2"
        );
        assert_eq!(
            resolve_backing_name("/d/top.qcow2", "nbd://h/base"),
            "nbd://h/base"
        );
        assert_eq!(
            resolve_backing_name("nbd+unix:///img/top.qcow2?socket=/s", "base.qcow2"),
            "nbd+unix:///img/base.qcow2?socket=/s"
        );
        assert_eq!(
            resolve_backing_name("nbd://h:10809/top", "base"),
            "nbd://h:10809/base"
        );
        // An unparsable parent URI leaves the name as it stands.
        assert_eq!(resolve_backing_name("nbd://", "base"), "base");
    }

    #[test]
    fn tells_whether_two_uris_name_one_server() {
        let s = "nbd+unix:///top?socket=/run/s";
        assert!(same_server(s, "nbd+unix:///base?socket=/run/s"));
        assert!(same_server(s, "nbds+unix:///base?socket=/run/s"));
        assert!(!same_server(s, "nbd+unix:///base?socket=/run/other"));
        assert!(same_server("nbd://h/a", "nbd://h:10809/b"));
        assert!(!same_server("nbd://h/a", "nbd://h:10810/a"));
        assert!(!same_server("nbd://h/a", "nbd://g/a"));
        assert!(!same_server("nbd://h/a", "/h/a"));
        assert!(!same_server("nbd://", "nbd://"));
    }
}
