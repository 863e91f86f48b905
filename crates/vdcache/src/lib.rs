//! The parts of the `vdcache` command that turn text into settings: the
//! server's configuration file ([`config`]) and size arguments ([`size`]).
//!
//! They live in a library so that the fuzz targets (fuzz/) and the bounded
//! fuzz test reach exactly the code the command runs ([`fuzzing`]). This
//! crate is part of the command, not a storage library: its errors are
//! `anyhow` errors meant for the user, and it must not open images or
//! devices.

pub mod config;
pub mod fuzzing;
pub mod size;
