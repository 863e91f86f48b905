//! Reports: Markdown tables, JSON, and SVG/PNG plots.
//!
//! This module owns presentation: a Markdown table from headers and rows,
//! JSON from anything `Serialize`, a line plot (e.g. hit ratio vs cache size,
//! one line per policy) and a grouped bar plot (e.g. flash writes and backend
//! traffic per policy). The output format of a plot follows the file
//! extension, `.svg` or `.png`.
//!
//! It must not compute results and must not depend on the machine's fonts:
//! text is drawn with a subset of DejaVu Sans embedded in the crate
//! (`assets/DejaVuSans-subset.ttf`, Basic Latin and Latin-1, licence in
//! `assets/DejaVuSans-LICENSE.txt`), registered once with plotters'
//! `ab_glyph` backend. Characters outside the subset are not drawn.

use std::fs::File;
use std::io::{BufWriter, Write};
use std::path::Path;
use std::sync::OnceLock;

use plotters::coord::ranged1d::{DefaultFormatting, KeyPointHint};
use plotters::prelude::*;
use plotters::style::{FontStyle, register_font};

static FONT: &[u8] = include_bytes!("../assets/DejaVuSans-subset.ttf");

/// Errors from writing a report.
#[derive(Debug, thiserror::Error)]
pub enum ReportError {
    #[error("{path}: {source}")]
    Io {
        path: String,
        source: std::io::Error,
    },
    #[error("JSON: {0}")]
    Json(#[from] serde_json::Error),
    #[error("plot {path}: {message}")]
    Plot { path: String, message: String },
    #[error("{0}: plot files must end in .svg or .png")]
    UnsupportedExtension(String),
    #[error("font: {0}")]
    Font(String),
}

// ---------------------------------------------------------------------------
// Tables and JSON

fn escape_cell(s: &str) -> String {
    s.replace('\\', "\\\\")
        .replace('|', "\\|")
        .replace(['\n', '\r'], " ")
}

fn looks_numeric(s: &str) -> bool {
    let t = s.trim().trim_end_matches('%');
    !t.is_empty() && t.parse::<f64>().is_ok()
}

/// A GitHub-flavoured Markdown table. Columns whose cells are all numbers
/// (optionally with a `%`) are right-aligned. Short rows are padded with
/// empty cells; `|` and line breaks in cells are escaped. No columns at all
/// give an empty string.
pub fn markdown_table<H: AsRef<str>>(headers: &[H], rows: &[Vec<String>]) -> String {
    let cols = headers
        .len()
        .max(rows.iter().map(Vec::len).max().unwrap_or(0));
    if cols == 0 {
        return String::new();
    }
    let cell = |r: &Vec<String>, c: usize| r.get(c).map(|s| escape_cell(s)).unwrap_or_default();
    let head: Vec<String> = (0..cols)
        .map(|c| {
            headers
                .get(c)
                .map(|h| escape_cell(h.as_ref()))
                .unwrap_or_default()
        })
        .collect();
    let numeric: Vec<bool> = (0..cols)
        .map(|c| {
            !rows.is_empty()
                && rows
                    .iter()
                    .all(|r| r.get(c).is_some_and(|s| looks_numeric(s)))
        })
        .collect();
    let mut widths: Vec<usize> = head.iter().map(|h| h.chars().count().max(3)).collect();
    for r in rows {
        for (c, w) in widths.iter_mut().enumerate() {
            *w = (*w).max(cell(r, c).chars().count());
        }
    }
    let pad = |s: &str, w: usize, right: bool| {
        let n = w.saturating_sub(s.chars().count());
        if right {
            format!("{}{s}", " ".repeat(n))
        } else {
            format!("{s}{}", " ".repeat(n))
        }
    };
    let mut out = String::new();
    let line = |cells: Vec<String>| format!("| {} |\n", cells.join(" | "));
    out.push_str(&line(
        (0..cols).map(|c| pad(&head[c], widths[c], false)).collect(),
    ));
    out.push_str(&line(
        (0..cols)
            .map(|c| {
                if numeric[c] {
                    format!("{}:", "-".repeat(widths[c] - 1))
                } else {
                    "-".repeat(widths[c])
                }
            })
            .collect(),
    ));
    for r in rows {
        out.push_str(&line(
            (0..cols)
                .map(|c| pad(&cell(r, c), widths[c], numeric[c]))
                .collect(),
        ));
    }
    out
}

/// Format a float with `decimals` digits; non-finite values as `-`.
pub fn fmt_f64(v: f64, decimals: usize) -> String {
    if v.is_finite() {
        format!("{v:.decimals$}")
    } else {
        "-".to_string()
    }
}

/// Pretty-printed JSON of `value`.
pub fn to_json<T: serde::Serialize + ?Sized>(value: &T) -> Result<String, ReportError> {
    Ok(serde_json::to_string_pretty(value)?)
}

/// Write `text` to `path`.
pub fn write_text(path: &Path, text: &str) -> Result<(), ReportError> {
    let io = |source| ReportError::Io {
        path: path.display().to_string(),
        source,
    };
    let mut f = BufWriter::new(File::create(path).map_err(io)?);
    f.write_all(text.as_bytes()).map_err(io)?;
    f.flush().map_err(io)
}

/// Write `value` as pretty JSON (with a final newline) to `path`.
pub fn write_json<T: serde::Serialize + ?Sized>(path: &Path, value: &T) -> Result<(), ReportError> {
    let mut s = to_json(value)?;
    s.push('\n');
    write_text(path, &s)
}

// ---------------------------------------------------------------------------
// Plots

const SIZE: (u32, u32) = (900, 560);

fn ensure_font() -> Result<(), ReportError> {
    static DONE: OnceLock<Result<(), String>> = OnceLock::new();
    DONE.get_or_init(|| {
        for family in ["sans-serif", "serif", "monospace"] {
            for style in [
                FontStyle::Normal,
                FontStyle::Bold,
                FontStyle::Italic,
                FontStyle::Oblique,
            ] {
                register_font(family, style, FONT)
                    .map_err(|_| "embedded font is not a valid TrueType font".to_string())?;
            }
        }
        Ok(())
    })
    .clone()
    .map_err(ReportError::Font)
}

#[derive(Clone, Copy)]
enum Kind {
    Svg,
    Png,
}

fn kind_of(path: &Path) -> Result<Kind, ReportError> {
    match path
        .extension()
        .and_then(|e| e.to_str())
        .map(str::to_ascii_lowercase)
        .as_deref()
    {
        Some("svg") => Ok(Kind::Svg),
        Some("png") => Ok(Kind::Png),
        _ => Err(ReportError::UnsupportedExtension(
            path.display().to_string(),
        )),
    }
}

fn plot_err(path: &Path, e: impl std::fmt::Display) -> ReportError {
    ReportError::Plot {
        path: path.display().to_string(),
        message: e.to_string(),
    }
}

/// Colours for series, in order (colour-blind friendly, Okabe-Ito).
const PALETTE: [RGBColor; 8] = [
    RGBColor(0, 114, 178),
    RGBColor(213, 94, 0),
    RGBColor(0, 158, 115),
    RGBColor(204, 121, 167),
    RGBColor(230, 159, 0),
    RGBColor(86, 180, 233),
    RGBColor(240, 228, 66),
    RGBColor(0, 0, 0),
];

fn colour(i: usize) -> RGBColor {
    PALETTE[i % PALETTE.len()]
}

/// Axis range covering `values`, padded, always non-empty; includes 0 when
/// `from_zero`.
fn axis_range(values: impl Iterator<Item = f64>, from_zero: bool) -> (f64, f64) {
    let (mut lo, mut hi) = (f64::INFINITY, f64::NEG_INFINITY);
    for v in values.filter(|v| v.is_finite()) {
        lo = lo.min(v);
        hi = hi.max(v);
    }
    if !lo.is_finite() {
        return (0.0, 1.0);
    }
    if from_zero {
        lo = lo.min(0.0);
        hi = hi.max(0.0);
    }
    if hi - lo < 1e-12 {
        return (lo - 0.5, hi + 0.5);
    }
    let pad = (hi - lo) * 0.05;
    (if from_zero && lo >= 0.0 { lo } else { lo - pad }, hi + pad)
}

/// A line plot with one line (and markers) per series, written to `path`
/// (`.svg` or `.png`). Non-finite points are dropped; the y axis starts at 0
/// when all values are >= 0.
pub fn line_plot(
    title: &str,
    x_label: &str,
    y_label: &str,
    series: &[(String, Vec<(f64, f64)>)],
    path: &Path,
) -> Result<(), ReportError> {
    ensure_font()?;
    match kind_of(path)? {
        Kind::Svg => draw_lines(
            SVGBackend::new(path, SIZE).into_drawing_area(),
            title,
            x_label,
            y_label,
            series,
            path,
        ),
        Kind::Png => draw_lines(
            BitMapBackend::new(path, SIZE).into_drawing_area(),
            title,
            x_label,
            y_label,
            series,
            path,
        ),
    }
}

fn draw_lines<DB: DrawingBackend>(
    root: DrawingArea<DB, plotters::coord::Shift>,
    title: &str,
    x_label: &str,
    y_label: &str,
    series: &[(String, Vec<(f64, f64)>)],
    path: &Path,
) -> Result<(), ReportError> {
    let pe = |e: DrawingAreaErrorKind<DB::ErrorType>| plot_err(path, e);
    let clean: Vec<(&String, Vec<(f64, f64)>)> = series
        .iter()
        .map(|(n, pts)| {
            (
                n,
                pts.iter()
                    .copied()
                    .filter(|(x, y)| x.is_finite() && y.is_finite())
                    .collect(),
            )
        })
        .collect();
    let all = || clean.iter().flat_map(|(_, p)| p.iter().copied());
    let (x0, x1) = axis_range(all().map(|p| p.0), false);
    let (y0, y1) = axis_range(all().map(|p| p.1), true);
    root.fill(&WHITE).map_err(pe)?;
    let mut chart = ChartBuilder::on(&root)
        .caption(title, ("sans-serif", 24))
        .margin(16)
        .x_label_area_size(48)
        .y_label_area_size(72)
        .build_cartesian_2d(x0..x1, y0..y1)
        .map_err(pe)?;
    chart
        .configure_mesh()
        .x_desc(x_label)
        .y_desc(y_label)
        .label_style(("sans-serif", 15))
        .axis_desc_style(("sans-serif", 17))
        .light_line_style(RGBColor(235, 235, 235))
        .draw()
        .map_err(pe)?;
    for (i, (name, pts)) in clean.iter().enumerate() {
        let c = colour(i);
        chart
            .draw_series(LineSeries::new(pts.iter().copied(), c.stroke_width(2)))
            .map_err(pe)?
            .label(name.as_str())
            .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], c.stroke_width(2)));
        chart
            .draw_series(pts.iter().map(|&p| Circle::new(p, 3, c.filled())))
            .map_err(pe)?;
    }
    if !clean.is_empty() {
        chart
            .configure_series_labels()
            .position(SeriesLabelPosition::LowerRight)
            .background_style(WHITE.mix(0.85))
            .border_style(BLACK)
            .label_font(("sans-serif", 15))
            .draw()
            .map_err(pe)?;
    }
    root.present().map_err(pe)
}

/// A grouped bar plot: one group per category (e.g. policy) along x, one bar
/// per series (e.g. "flash writes", "backend bytes") in each group, written
/// to `path` (`.svg` or `.png`). `series[i].1[j]` is the value of series i
/// for category j; missing or non-finite values draw no bar.
pub fn grouped_bar_plot(
    title: &str,
    x_label: &str,
    y_label: &str,
    categories: &[String],
    series: &[(String, Vec<f64>)],
    path: &Path,
) -> Result<(), ReportError> {
    ensure_font()?;
    match kind_of(path)? {
        Kind::Svg => draw_bars(
            SVGBackend::new(path, SIZE).into_drawing_area(),
            title,
            x_label,
            y_label,
            categories,
            series,
            path,
        ),
        Kind::Png => draw_bars(
            BitMapBackend::new(path, SIZE).into_drawing_area(),
            title,
            x_label,
            y_label,
            categories,
            series,
            path,
        ),
    }
}

/// An x axis of `n` categories: category i spans [i, i + 1], and the only
/// key points (labels) are the centres i + 0.5.
struct CategoryAxis {
    n: usize,
}

impl Ranged for CategoryAxis {
    type FormatOption = DefaultFormatting;
    type ValueType = f64;

    fn map(&self, value: &f64, limit: (i32, i32)) -> i32 {
        let frac = value / self.n as f64;
        limit.0 + (frac * f64::from(limit.1 - limit.0)).round() as i32
    }

    fn key_points<Hint: KeyPointHint>(&self, _hint: Hint) -> Vec<f64> {
        (0..self.n).map(|i| i as f64 + 0.5).collect()
    }

    fn range(&self) -> std::ops::Range<f64> {
        0.0..self.n as f64
    }
}

fn draw_bars<DB: DrawingBackend>(
    root: DrawingArea<DB, plotters::coord::Shift>,
    title: &str,
    x_label: &str,
    y_label: &str,
    categories: &[String],
    series: &[(String, Vec<f64>)],
    path: &Path,
) -> Result<(), ReportError> {
    let pe = |e: DrawingAreaErrorKind<DB::ErrorType>| plot_err(path, e);
    let n = categories.len().max(1);
    let (_, y1) = axis_range(
        series
            .iter()
            .flat_map(|(_, v)| v.iter().copied())
            .filter(|v| *v >= 0.0),
        true,
    );
    let (y0, _) = axis_range(series.iter().flat_map(|(_, v)| v.iter().copied()), true);
    root.fill(&WHITE).map_err(pe)?;
    let names = categories.to_vec();
    let label_of = move |x: &f64| -> String {
        let i = (x - 0.5).round();
        if (x - 0.5 - i).abs() < 1e-6 && i >= 0.0 {
            names.get(i as usize).cloned().unwrap_or_default()
        } else {
            String::new()
        }
    };
    let mut chart = ChartBuilder::on(&root)
        .caption(title, ("sans-serif", 24))
        .margin(16)
        .x_label_area_size(48)
        .y_label_area_size(72)
        .build_cartesian_2d(CategoryAxis { n }, y0..y1)
        .map_err(pe)?;
    chart
        .configure_mesh()
        .disable_x_mesh()
        .x_desc(x_label)
        .y_desc(y_label)
        .x_label_formatter(&label_of)
        .label_style(("sans-serif", 15))
        .axis_desc_style(("sans-serif", 17))
        .light_line_style(RGBColor(235, 235, 235))
        .draw()
        .map_err(pe)?;
    let k = series.len().max(1) as f64;
    let width = 0.8 / k;
    for (s, (name, values)) in series.iter().enumerate() {
        let c = colour(s);
        let bars = values
            .iter()
            .enumerate()
            .take(n)
            .filter(|(_, v)| v.is_finite())
            .map(|(j, &v)| {
                let left = j as f64 + 0.1 + s as f64 * width;
                Rectangle::new([(left, 0.0), (left + width * 0.92, v)], c.filled())
            });
        chart
            .draw_series(bars)
            .map_err(pe)?
            .label(name.as_str())
            .legend(move |(x, y)| Rectangle::new([(x, y - 6), (x + 14, y + 6)], c.filled()));
    }
    if !series.is_empty() {
        chart
            .configure_series_labels()
            .position(SeriesLabelPosition::UpperRight)
            .background_style(WHITE.mix(0.85))
            .border_style(BLACK)
            .label_font(("sans-serif", 15))
            .draw()
            .map_err(pe)?;
    }
    root.present().map_err(pe)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn markdown_alignment_and_escaping() {
        let t = markdown_table(
            &["policy", "hit ratio", "note"],
            &[
                vec!["lru".into(), "0.52".into(), "a|b".into()],
                vec!["arc".into(), "61%".into()],
            ],
        );
        let lines: Vec<&str> = t.lines().collect();
        assert_eq!(lines[0], "| policy | hit ratio | note |");
        assert_eq!(lines[1], "| ------ | --------: | ---- |");
        assert_eq!(lines[2], "| lru    |      0.52 | a\\|b |");
        assert_eq!(lines[3], "| arc    |       61% |      |");
        assert_eq!(markdown_table::<&str>(&[], &[]), "");
    }

    #[test]
    fn json_and_numbers() {
        #[derive(serde::Serialize)]
        struct Row {
            policy: &'static str,
            read_hit_ratio: f64,
        }
        let s = to_json(&[Row {
            policy: "lru",
            read_hit_ratio: 0.5,
        }])
        .expect("serializes");
        assert!(s.contains("\"read_hit_ratio\": 0.5"));
        assert_eq!(fmt_f64(1.23456, 2), "1.23");
        assert_eq!(fmt_f64(f64::NAN, 2), "-");
    }

    #[test]
    fn axis_ranges() {
        assert_eq!(axis_range([].into_iter(), true), (0.0, 1.0));
        assert_eq!(axis_range([2.0, 2.0].into_iter(), false), (1.5, 2.5));
        let (lo, hi) = axis_range([0.2, 0.9].into_iter(), true);
        assert_eq!(lo, 0.0);
        assert!(hi > 0.9);
    }

    #[test]
    fn unsupported_extension() {
        let r = line_plot("t", "x", "y", &[], Path::new("/tmp/x.pdf"));
        assert!(matches!(r, Err(ReportError::UnsupportedExtension(_))));
    }
}
