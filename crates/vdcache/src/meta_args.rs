//! Command-line settings of the metadata cache, shared by subcommands.

use crate::size::parse_size;
use anyhow::{Result, bail};
use vdcache::config::parse_meta_cache_size;
use vdcache_image::MetaCacheConfig;

#[derive(clap::Args, Debug, Clone, Default)]
pub struct MetaCacheArgs {
    /// Memory for cached L2 table slices (default 4M).
    #[arg(long = "l2-cache-size", value_name = "SIZE")]
    pub l2_cache_size: Option<String>,
    /// Memory for cached refcount block slices (default 1M).
    #[arg(long = "refcount-cache-size", value_name = "SIZE")]
    pub refcount_cache_size: Option<String>,
    /// Slice size: from 512 (one sector) up to the cluster size (whole
    /// tables, the default).
    #[arg(long = "meta-slice-size", value_name = "SIZE")]
    pub slice_size: Option<String>,
}

impl MetaCacheArgs {
    pub fn config(&self) -> Result<MetaCacheConfig> {
        let mut c = MetaCacheConfig::default();
        if let Some(s) = &self.l2_cache_size {
            c.l2_bytes = parse_meta_cache_size("--l2-cache-size", s)?;
        }
        if let Some(s) = &self.refcount_cache_size {
            c.refcount_bytes = parse_meta_cache_size("--refcount-cache-size", s)?;
        }
        if let Some(s) = &self.slice_size {
            let v = parse_size(s)?;
            if !v.is_power_of_two() || !(512..=2 << 20).contains(&v) {
                bail!("--meta-slice-size {s}: must be a power of two from 512 to 2M");
            }
            c.slice_bytes = Some(v);
        }
        Ok(c)
    }
}
