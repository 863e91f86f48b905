//! The command-line setting of where a chain may reach, shared by every
//! command that opens a chain (serve, info, check, io, convert, recover).

#[derive(clap::Args, Debug, Clone, Default)]
pub struct BackingArgs {
    /// Also let backing files and external data files lie in this
    /// directory's tree, or on this NBD storage server (a URI); repeat for
    /// more. By default a chain reaches only its top image's directory tree
    /// and the storage server the top image is on: a backing name in an
    /// image's header can name any host file.
    #[arg(long = "allow-backing", value_name = "DIR|URI")]
    pub allow_backing: Vec<String>,
}
