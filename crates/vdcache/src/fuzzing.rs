//! Entry point shared by the config fuzz target (fuzz/) and the bounded
//! fuzz test of the suite: arbitrary bytes given to the configuration
//! parser exactly as `vdcache serve --config` gives a file's text.
//!
//! Owns no parsing. Any error is a correct outcome; a panic is a finding.

use crate::config::ServerConfig;

/// Parses and validates `data` as a server configuration file. Bytes that
/// are not UTF-8 are what `load` refuses before parsing, so they stop here.
pub fn exercise_config(data: &[u8]) {
    let Ok(text) = std::str::from_utf8(data) else {
        return;
    };
    match ServerConfig::parse(text) {
        Ok(cfg) => {
            // What validation promises the daemon.
            assert!(!cfg.exports.is_empty(), "a config without exports passed");
            assert!(
                cfg.server.socket.is_some()
                    || cfg.server.tcp.is_some()
                    || cfg.server.fuse.is_some(),
                "a config without a listener passed"
            );
        }
        Err(e) => assert!(!e.to_string().is_empty(), "an error without a message"),
    }
}
