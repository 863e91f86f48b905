//! `vdcache plot`: draws a line or grouped bar chart described in JSON (as
//! the bench scripts write them) to SVG and PNG. Parsing only; drawing is
//! the evaluation crate's.

use anyhow::{Context, Result};
use std::path::PathBuf;
use vdcache_eval::report::{grouped_bar_plot, line_plot};

#[derive(clap::Args)]
pub struct Args {
    /// JSON: {"kind": "line", "title", "x_label", "y_label", "series":
    /// [{"name", "points": [[x, y], ...]}]} or {"kind": "bar", ...,
    /// "categories": [...], "series": [{"name", "values": [...]}]}.
    spec: PathBuf,
    /// Output path without extension: PREFIX.svg and PREFIX.png are written.
    #[arg(long)]
    out: PathBuf,
}

#[derive(serde::Deserialize)]
#[serde(tag = "kind", rename_all = "lowercase", deny_unknown_fields)]
enum Spec {
    Line {
        title: String,
        x_label: String,
        y_label: String,
        series: Vec<LineSeries>,
    },
    Bar {
        title: String,
        x_label: String,
        y_label: String,
        categories: Vec<String>,
        series: Vec<BarSeries>,
    },
}

#[derive(serde::Deserialize)]
#[serde(deny_unknown_fields)]
struct LineSeries {
    name: String,
    points: Vec<(f64, f64)>,
}

#[derive(serde::Deserialize)]
#[serde(deny_unknown_fields)]
struct BarSeries {
    name: String,
    values: Vec<f64>,
}

pub fn run(a: Args) -> Result<u8> {
    let text = std::fs::read_to_string(&a.spec)
        .with_context(|| format!("cannot read {}", a.spec.display()))?;
    let spec: Spec = serde_json::from_str(&text)
        .with_context(|| format!("{} is not a plot description", a.spec.display()))?;
    for ext in ["svg", "png"] {
        let path = a.out.with_extension(ext);
        match &spec {
            Spec::Line {
                title,
                x_label,
                y_label,
                series,
            } => {
                let series: Vec<(String, Vec<(f64, f64)>)> = series
                    .iter()
                    .map(|s| (s.name.clone(), s.points.clone()))
                    .collect();
                line_plot(title, x_label, y_label, &series, &path)
            }
            Spec::Bar {
                title,
                x_label,
                y_label,
                categories,
                series,
            } => {
                let series: Vec<(String, Vec<f64>)> = series
                    .iter()
                    .map(|s| (s.name.clone(), s.values.clone()))
                    .collect();
                grouped_bar_plot(title, x_label, y_label, categories, &series, &path)
            }
        }
        .with_context(|| format!("cannot draw {}", path.display()))?;
        outln!("{}", path.display());
    }
    Ok(0)
}
