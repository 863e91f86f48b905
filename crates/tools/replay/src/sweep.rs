//! A sweep: one trace replayed at several cache sizes (percent of the
//! working set) under several replacement policies, each with and/or
//! without dedup, scanned once; the results as a Markdown table, JSON, and
//! plots (hit ratio and flash bytes written against cache size, as DASH
//! Fig. 4; flash writes and backend traffic per configuration, as COWCache
//! Fig. 15). A configuration is a policy, a dedup mode and an admission
//! policy ("lru", "lru+dedup", "d-lru+dedup/hot"). It must not alter a
//! single replay's figures.

use crate::replay::{
    CacheSize, Progress, ReplayError, ReplayOptions, ReplayReport, replay_scanned,
};
use crate::scan::scan_trace;
use std::path::{Path, PathBuf};
use vdcache_cache::{Admission, Dedup, Replacement};
use vdcache_eval::Format;
use vdcache_eval::report::{
    ReportError, fmt_f64, grouped_bar_plot, line_plot, markdown_table, write_json, write_text,
};

/// What to sweep.
#[derive(Debug, Clone)]
pub struct SweepOptions {
    /// Everything but the cache size, the policy and dedup.
    pub base: ReplayOptions,
    pub percents: Vec<f64>,
    pub policies: Vec<Replacement>,
    /// Dedup modes each policy runs with (e.g. off and on).
    pub dedups: Vec<Dedup>,
    /// Admission policies each (policy, dedup mode) runs with.
    pub admissions: Vec<Admission>,
}

/// The default sizes: 10% to 100% of the working set.
pub const DEFAULT_PERCENTS: [f64; 6] = [10.0, 25.0, 40.0, 55.0, 70.0, 100.0];

/// Where a step of a sweep is, for progress.
#[derive(Debug, Clone, Copy)]
pub struct SweepProgress {
    pub run: usize,
    pub runs: usize,
    pub inner: Progress,
}

/// Replays `path` once per (policy, dedup mode, admission, size), in that
/// order. No dedup modes or admissions: the base options' one.
pub fn sweep(
    path: &Path,
    format: Option<Format>,
    opts: &SweepOptions,
    progress: &mut dyn FnMut(SweepProgress),
) -> Result<Vec<ReplayReport>, ReplayError> {
    let scan = scan_trace(path, format)?;
    let dedups = if opts.dedups.is_empty() {
        vec![opts.base.rig.dedup]
    } else {
        opts.dedups.clone()
    };
    let admissions = if opts.admissions.is_empty() {
        vec![opts.base.rig.policy.admission]
    } else {
        opts.admissions.clone()
    };
    let cells: Vec<(Replacement, Dedup, Admission, f64)> = opts
        .policies
        .iter()
        .flat_map(|&policy| dedups.iter().map(move |&dedup| (policy, dedup)))
        .flat_map(|(policy, dedup)| {
            admissions
                .iter()
                .map(move |&admission| (policy, dedup, admission))
        })
        .flat_map(|(policy, dedup, admission)| {
            opts.percents
                .iter()
                .map(move |&pct| (policy, dedup, admission, pct))
        })
        .collect();
    let runs = cells.len();
    let mut out = Vec::with_capacity(runs);
    for (policy, dedup, admission, pct) in cells {
        let mut one = opts.base.clone();
        one.rig.replacement = policy;
        one.rig.dedup = dedup;
        one.rig.policy.admission = admission;
        one.cache_size = CacheSize::PercentOfWorkingSet(pct);
        let run = out.len();
        let report = replay_scanned(path, format, &scan, &one, &mut |inner| {
            progress(SweepProgress { run, runs, inner })
        })?;
        out.push(report);
    }
    Ok(out)
}

/// A report's configuration: its policy, "+dedup" (or "+dedup-verify")
/// when it deduplicates, "/ADMISSION" when it admits other than all.
pub fn config_label(r: &ReplayReport) -> String {
    let dedup = match r.dedup_mode {
        "off" => String::new(),
        "on" => "+dedup".into(),
        mode => format!("+dedup-{mode}"),
    };
    let admission = match r.admission {
        "all" => String::new(),
        other => format!("/{other}"),
    };
    format!("{}{dedup}{admission}", r.policy)
}

/// The configurations of `reports`, in order of first appearance.
fn configs(reports: &[ReplayReport]) -> Vec<String> {
    let mut out: Vec<String> = Vec::new();
    for r in reports {
        let l = config_label(r);
        if !out.contains(&l) {
            out.push(l);
        }
    }
    out
}

fn mib(b: u64) -> String {
    fmt_f64(b as f64 / f64::from(1 << 20), 1)
}

/// The sweep as a Markdown table.
pub fn sweep_table(reports: &[ReplayReport]) -> String {
    let headers = [
        "policy",
        "dedup",
        "admission",
        "cache % WSS",
        "cache MiB",
        "read hit",
        "write hit",
        "flash written MiB",
        "dedup ratio",
        "flash saved MiB",
        "backend read MiB",
        "backend written MiB",
        "mean latency us",
        "p99 latency us",
        "FTL WA",
    ];
    let rows: Vec<Vec<String>> = reports
        .iter()
        .map(|r| {
            vec![
                r.policy.to_string(),
                r.dedup_mode.to_string(),
                r.admission.to_string(),
                r.cache_percent_of_working_set
                    .map_or_else(|| "-".into(), |p| fmt_f64(p, 0)),
                mib(r.cache_bytes),
                fmt_f64(r.read_hit_ratio, 4),
                fmt_f64(r.write_hit_ratio, 4),
                mib(r.flash_bytes_written),
                r.dedup.map_or_else(|| "-".into(), |d| fmt_f64(d.ratio, 3)),
                r.dedup
                    .map_or_else(|| "-".into(), |d| mib(d.flash_bytes_saved)),
                mib(r.backend_bytes_read),
                mib(r.backend_bytes_written),
                fmt_f64(r.latency.mean_ns / 1000.0, 1),
                fmt_f64(r.latency.p99_ns as f64 / 1000.0, 1),
                r.ftl_write_amplification
                    .map_or_else(|| "-".into(), |w| fmt_f64(w, 3)),
            ]
        })
        .collect();
    markdown_table(&headers, &rows)
}

/// Writes `sweep.md`, `sweep.json`, `hit_ratio.{svg,png}`,
/// `flash_written.{svg,png}` and `traffic.{svg,png}` into `dir`; returns
/// the files written.
pub fn write_sweep(dir: &Path, reports: &[ReplayReport]) -> Result<Vec<PathBuf>, ReportError> {
    std::fs::create_dir_all(dir).map_err(|e| ReportError::Io {
        path: dir.display().to_string(),
        source: e,
    })?;
    let mut written = Vec::new();
    let md = dir.join("sweep.md");
    write_text(&md, &sweep_table(reports))?;
    written.push(md);
    let json = dir.join("sweep.json");
    write_json(&json, reports)?;
    written.push(json);

    let configs = configs(reports);
    let gib = |b: u64| b as f64 / f64::from(1 << 30);
    let series = |y: &dyn Fn(&ReplayReport) -> f64| -> Vec<(String, Vec<(f64, f64)>)> {
        configs
            .iter()
            .map(|c| {
                let pts = reports
                    .iter()
                    .filter(|r| config_label(r) == *c)
                    .filter_map(|r| Some((r.cache_percent_of_working_set?, y(r))))
                    .collect();
                (c.clone(), pts)
            })
            .collect()
    };
    let hit_series = series(&|r| r.read_hit_ratio);
    let flash_series = series(&|r| gib(r.flash_bytes_written));
    // Traffic at the largest size swept below the whole working set, where
    // policies differ most; the full-size point if that is all there is.
    let size = reports
        .iter()
        .filter_map(|r| r.cache_percent_of_working_set)
        .filter(|&p| p < 100.0)
        .fold(None, |m: Option<f64>, p| Some(m.map_or(p, |m| m.max(p))))
        .or_else(|| reports.first().and_then(|r| r.cache_percent_of_working_set));
    let at_size: Vec<&ReplayReport> = configs
        .iter()
        .filter_map(|c| {
            reports
                .iter()
                .find(|r| config_label(r) == *c && r.cache_percent_of_working_set == size)
        })
        .collect();
    let categories: Vec<String> = at_size.iter().map(|r| config_label(r)).collect();
    let traffic = vec![
        (
            "flash written".to_string(),
            at_size.iter().map(|r| gib(r.flash_bytes_written)).collect(),
        ),
        (
            "backend read".to_string(),
            at_size.iter().map(|r| gib(r.backend_bytes_read)).collect(),
        ),
        (
            "backend written".to_string(),
            at_size
                .iter()
                .map(|r| gib(r.backend_bytes_written))
                .collect(),
        ),
    ];
    for ext in ["svg", "png"] {
        let p = dir.join(format!("hit_ratio.{ext}"));
        line_plot(
            "Read hit ratio against cache size",
            "cache size (% of working set)",
            "read hit ratio (4 KiB blocks)",
            &hit_series,
            &p,
        )?;
        written.push(p);
        let p = dir.join(format!("flash_written.{ext}"));
        line_plot(
            "Flash bytes written against cache size",
            "cache size (% of working set)",
            "flash written (GiB)",
            &flash_series,
            &p,
        )?;
        written.push(p);
        let p = dir.join(format!("traffic.{ext}"));
        let title = format!(
            "Flash and backend traffic per configuration (cache {}% of working set)",
            size.map_or_else(|| "-".into(), |s| fmt_f64(s, 0))
        );
        grouped_bar_plot(&title, "configuration", "GiB", &categories, &traffic, &p)?;
        written.push(p);
    }
    Ok(written)
}
