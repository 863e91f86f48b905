//! Plots render to SVG and PNG with the embedded font, and tables/JSON are
//! written to files.

use std::path::Path;

use vdcache_eval::report::{grouped_bar_plot, line_plot, markdown_table, write_json, write_text};

fn hit_ratio_series() -> Vec<(String, Vec<(f64, f64)>)> {
    let sizes = [10.0, 25.0, 50.0, 75.0, 100.0];
    vec![
        (
            "lru".to_string(),
            sizes.iter().map(|&s| (s, 0.3 + s / 250.0)).collect(),
        ),
        (
            "arc".to_string(),
            sizes.iter().map(|&s| (s, 0.35 + s / 230.0)).collect(),
        ),
        (
            "clock".to_string(),
            sizes.iter().map(|&s| (s, 0.29 + s / 260.0)).collect(),
        ),
    ]
}

fn check_png(path: &Path) {
    let bytes = std::fs::read(path).expect("png written");
    assert!(bytes.starts_with(b"\x89PNG\r\n\x1a\n"), "PNG signature");
    assert!(
        bytes.len() > 10_000,
        "a 900x560 plot with text is not tiny: {} bytes",
        bytes.len()
    );
}

#[test]
fn line_and_bar_plots_in_svg_and_png() {
    let dir = tempfile::tempdir().expect("tempdir");
    let series = hit_ratio_series();
    for ext in ["svg", "png"] {
        let p = dir.path().join(format!("hit.{ext}"));
        line_plot(
            "Read hit ratio vs cache size",
            "cache size (% of working set)",
            "read hit ratio",
            &series,
            &p,
        )
        .expect("line plot");
        let b = dir.path().join(format!("bars.{ext}"));
        let cats = vec![
            "lru".to_string(),
            "clock".to_string(),
            "arc".to_string(),
            "dedup-arc".to_string(),
        ];
        let bars = vec![
            ("flash writes (GiB)".to_string(), vec![12.0, 11.5, 9.0, 4.0]),
            (
                "backend bytes (GiB)".to_string(),
                vec![30.0, 31.0, 25.0, 24.0],
            ),
        ];
        grouped_bar_plot(
            "Flash writes and backend traffic",
            "policy",
            "GiB",
            &cats,
            &bars,
            &b,
        )
        .expect("bar plot");
        if ext == "png" {
            check_png(&p);
            check_png(&b);
        } else {
            let svg = std::fs::read_to_string(&p).expect("svg written");
            assert!(svg.contains("<svg") && svg.contains("Read hit ratio vs cache size"));
            let has_text = |svg: &str, t: &str| svg.lines().any(|l| l.trim() == t);
            assert!(has_text(&svg, "arc"), "legend names the series");
            let svg = std::fs::read_to_string(&b).expect("svg written");
            assert!(has_text(&svg, "dedup-arc"), "categories label the x axis");
        }
    }
    // Degenerate inputs still draw.
    let e = dir.path().join("empty.png");
    line_plot("empty", "x", "y", &[], &e).expect("empty plot");
    let nan = vec![(
        "nan".to_string(),
        vec![(f64::NAN, 1.0), (1.0, f64::INFINITY)],
    )];
    line_plot("nan", "x", "y", &nan, &dir.path().join("nan.svg")).expect("nan plot");
    grouped_bar_plot("none", "x", "y", &[], &[], &dir.path().join("none.svg")).expect("no bars");
    // An unwritable path is an error, not a panic.
    assert!(line_plot("t", "x", "y", &series, Path::new("/nonexistent-dir/x.png")).is_err());

    if let Some(out) = std::env::var_os("VDCACHE_EVAL_PLOT_DIR") {
        // For looking at the pictures: VDCACHE_EVAL_PLOT_DIR=/tmp/plots cargo test
        let out = Path::new(&out);
        std::fs::create_dir_all(out).expect("mkdir");
        for f in ["hit.png", "bars.png", "hit.svg", "bars.svg", "empty.png"] {
            std::fs::copy(dir.path().join(f), out.join(f)).expect("copy");
        }
    }
}

#[test]
fn table_and_json_files() {
    let dir = tempfile::tempdir().expect("tempdir");
    let md = markdown_table(
        &["policy", "read_hit_ratio"],
        &[vec!["lru".into(), "0.500".into()]],
    );
    write_text(&dir.path().join("t.md"), &md).expect("write");
    assert_eq!(
        std::fs::read_to_string(dir.path().join("t.md")).expect("read"),
        md
    );
    #[derive(serde::Serialize)]
    struct Row {
        policy: String,
        read_hit_ratio: f64,
    }
    write_json(
        &dir.path().join("t.json"),
        &vec![Row {
            policy: "lru".into(),
            read_hit_ratio: 0.5,
        }],
    )
    .expect("json");
    let back: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dir.path().join("t.json")).expect("read"))
            .expect("valid json");
    assert_eq!(back[0]["read_hit_ratio"], 0.5);
    assert!(write_text(Path::new("/nonexistent-dir/t.md"), "x").is_err());
}
