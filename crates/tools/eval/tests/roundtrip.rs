//! Every generator's output, written in every format (plain, gzip, zstd),
//! reads back as the same records, modulo what the format cannot carry.

use std::fs::File;
use std::io::{BufWriter, Write};
use std::path::Path;

use vdcache_eval::trace::{
    FioVersion, Format, Op, TraceRecord, WriterOptions, new_writer, open_trace, split_record,
};
use vdcache_eval::workload::{WorkloadClass, WorkloadSpec, generate};

fn specs() -> Vec<WorkloadSpec> {
    [
        WorkloadClass::BootStorm,
        WorkloadClass::Oltp,
        WorkloadClass::FileServer,
        WorkloadClass::CloneStorm,
    ]
    .into_iter()
    .map(|class| WorkloadSpec {
        requests: 3000,
        working_set_bytes: 32 << 20,
        disks: if matches!(class, WorkloadClass::BootStorm | WorkloadClass::CloneStorm) {
            5
        } else {
            2
        },
        discard_ratio: 0.05,
        seed: 11,
        ..WorkloadSpec::new(class)
    })
    .collect()
}

/// What a format keeps of a record.
fn expected(format: Format, opts: &WriterOptions, recs: &[TraceRecord]) -> Vec<TraceRecord> {
    let strip = |r: &TraceRecord| TraceRecord {
        content: None,
        ..r.clone()
    };
    let data = recs.iter().filter(|r| matches!(r.op, Op::Read | Op::Write));
    match format {
        Format::Msr => data.map(strip).collect(),
        Format::Fiu if opts.fiu_split_blocks => data.flat_map(split_record).collect(),
        Format::Fiu => data.cloned().collect(),
        Format::Blkparse(_) | Format::Fio => recs.iter().map(strip).collect(),
    }
}

#[derive(Clone, Copy, Debug)]
enum Packing {
    Plain,
    Gzip,
    Zstd,
}

fn write_file(
    path: &Path,
    format: Format,
    opts: &WriterOptions,
    recs: &[TraceRecord],
    packing: Packing,
) -> u64 {
    let file = File::create(path).expect("create");
    let sink: Box<dyn Write> = match packing {
        Packing::Plain => Box::new(BufWriter::new(file)),
        Packing::Gzip => Box::new(flate2::write::GzEncoder::new(
            BufWriter::new(file),
            flate2::Compression::fast(),
        )),
        Packing::Zstd => Box::new(
            zstd::stream::write::Encoder::new(BufWriter::new(file), 1)
                .expect("zstd")
                .auto_finish(),
        ),
    };
    let mut w = new_writer(format, sink, opts);
    let mut skipped = 0;
    for r in recs {
        if !w.write_record(r).expect("representable") {
            skipped += 1;
        }
    }
    w.finish().expect("finish");
    drop(w);
    skipped
}

#[test]
fn every_generator_round_trips_through_every_format() {
    let dir = tempfile::tempdir().expect("tempdir");
    let formats: Vec<(&str, Format, WriterOptions)> = vec![
        ("msr.csv", Format::Msr, WriterOptions::default()),
        ("fiu.txt", Format::Fiu, WriterOptions::default()),
        (
            "fiu-joined.txt",
            Format::Fiu,
            WriterOptions {
                fiu_split_blocks: false,
                ..WriterOptions::default()
            },
        ),
        (
            "blk.txt",
            Format::Blkparse(Default::default()),
            WriterOptions::default(),
        ),
        (
            "blk-life.txt",
            Format::Blkparse(Default::default()),
            WriterOptions {
                blkparse_lifecycle: true,
                ..WriterOptions::default()
            },
        ),
        (
            "fio2.log",
            Format::Fio,
            WriterOptions {
                fio_version: FioVersion::V2,
                ..WriterOptions::default()
            },
        ),
        (
            "fio3.log",
            Format::Fio,
            WriterOptions {
                fio_version: FioVersion::V3,
                ..WriterOptions::default()
            },
        ),
    ];
    for spec in specs() {
        let recs: Vec<TraceRecord> = generate(&spec).expect("valid spec").collect();
        assert!(recs.iter().any(|r| r.op == Op::Write));
        for (name, format, opts) in &formats {
            let opts = WriterOptions {
                fio_disks: spec.disks,
                ..opts.clone()
            };
            let want = expected(*format, &opts, &recs);
            for (i, packing) in [Packing::Plain, Packing::Gzip, Packing::Zstd]
                .into_iter()
                .enumerate()
            {
                let file = match packing {
                    Packing::Plain => format!("{}-{}", spec.class, name),
                    Packing::Gzip => format!("{}-{}.gz", spec.class, name),
                    Packing::Zstd => format!("{}-{}.zst", spec.class, name),
                };
                let path = dir.path().join(file);
                write_file(&path, *format, &opts, &recs, packing);
                // Detect the format on the first packing, give it on the others.
                let given = if i == 0 { None } else { Some(*format) };
                let reader = open_trace(&path, given).expect("opens");
                assert_eq!(reader.format(), *format);
                let got: Vec<TraceRecord> = reader.collect::<Result<_, _>>().expect("reads back");
                assert_eq!(got.len(), want.len(), "{} {name} {packing:?}", spec.class);
                for (k, (g, w)) in got.iter().zip(&want).enumerate() {
                    assert_eq!(g, w, "{} {name} {packing:?} record {k}", spec.class);
                }
            }
        }
    }
}

#[test]
fn errors_name_the_line_through_compression() {
    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().join("bad.csv.gz");
    {
        let mut enc = flate2::write::GzEncoder::new(
            File::create(&path).expect("create"),
            flate2::Compression::fast(),
        );
        for i in 0..16 {
            writeln!(enc, "{},h,0,Read,{},4096,0", 1000 + i, i * 4096).expect("write");
        }
        writeln!(enc, "1016,h,0,Read,0,x,0").expect("write");
        writeln!(enc, "1017,h,0,Write,0,4096,0").expect("write");
        enc.finish().expect("finish");
    }
    let results: Vec<_> = open_trace(&path, None).expect("opens").collect();
    assert_eq!(results.len(), 18);
    let err = results[16].as_ref().expect_err("line 17 is bad");
    assert_eq!(
        err.to_string(),
        "line 17: field 6 (Size) is not a number: 'x'"
    );
    assert_eq!(err.line(), Some(17));
    assert!(results[17].is_ok(), "reading continues after a bad line");

    // A truncated gzip stream ends in a read error, not a panic.
    let bytes = std::fs::read(&path).expect("read");
    let cut = dir.path().join("cut.csv.gz");
    std::fs::write(&cut, &bytes[..bytes.len() / 2]).expect("write");
    let results: Vec<_> = open_trace(&cut, None).expect("opens").collect();
    assert!(results.last().is_some_and(|r| {
        r.as_ref()
            .is_err_and(|e| e.to_string().contains("read error"))
    }));

    // A .gz name on a file that is not gzip is refused, not misread.
    let lie = dir.path().join("plain.gz");
    std::fs::write(&lie, "1,h,0,Read,0,4096,0\n").expect("write");
    let e = open_trace(&lie, None).expect_err("not gzip");
    assert!(e.to_string().contains("compressed input"), "{e}");

    // Undetectable content and a missing file.
    let junk = dir.path().join("junk.txt");
    std::fs::write(&junk, "\n\nhello world\n").expect("write");
    assert!(
        open_trace(&junk, None)
            .expect_err("junk")
            .to_string()
            .contains("line 3 matches no known format")
    );
    assert!(open_trace(&dir.path().join("missing"), None).is_err());
    let empty = dir.path().join("empty.txt");
    std::fs::write(&empty, "").expect("write");
    assert!(open_trace(&empty, None).is_err());
    // An empty file with a format given reads as an empty trace.
    assert_eq!(
        open_trace(&empty, Some(Format::Msr))
            .expect("opens")
            .count(),
        0
    );
}

#[test]
fn generated_writes_drive_the_ftl() {
    use vdcache_eval::ftl::{Ftl, FtlConfig};
    let spec = WorkloadSpec {
        requests: 20_000,
        working_set_bytes: 16 << 20,
        read_ratio: 0.0,
        zipf_theta: 0.0,
        content: false,
        ..WorkloadSpec::new(WorkloadClass::Oltp)
    };
    let mut ftl =
        Ftl::new(FtlConfig::new(spec.disk_bytes(), 4096, 256 << 10, 0.07)).expect("geometry");
    for r in generate(&spec).expect("valid") {
        ftl.apply(&r).expect("in range");
    }
    let s = ftl.stats();
    assert!(s.host_pages_written >= 20_000);
    assert!(s.write_amplification.expect("wrote") >= 1.0);
}
