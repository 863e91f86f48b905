//! Measures generator, reader and FTL throughput (run with --release):
//! `cargo run --release -p vdcache-eval --example eval_speed [REQUESTS] [DIR]`

use std::fs::File;
use std::io::BufWriter;
use std::time::Instant;

use rand::{RngExt, SeedableRng};
use vdcache_eval::ftl::{Ftl, FtlConfig};
use vdcache_eval::trace::{Format, WriterOptions, open_trace};
use vdcache_eval::workload::{Rng, WorkloadClass, WorkloadSpec, generate, write_workload};

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let mut args = std::env::args().skip(1);
    let requests: u64 = args
        .next()
        .map(|a| a.parse())
        .transpose()?
        .unwrap_or(5_000_000);
    let dir = std::path::PathBuf::from(
        args.next()
            .unwrap_or_else(|| std::env::temp_dir().display().to_string()),
    );

    for class in [
        WorkloadClass::Oltp,
        WorkloadClass::BootStorm,
        WorkloadClass::FileServer,
    ] {
        let spec = WorkloadSpec {
            requests,
            ..WorkloadSpec::new(class)
        };
        let path = dir.join(format!("vdcache-eval-speed-{class}.csv"));
        let t = Instant::now();
        let sum = write_workload(
            &spec,
            Format::Msr,
            &WriterOptions::default(),
            BufWriter::new(File::create(&path)?),
        )?;
        let gen_s = t.elapsed().as_secs_f64();
        let size = std::fs::metadata(&path)?.len();
        let t = Instant::now();
        let mut n = 0u64;
        for r in open_trace(&path, None)? {
            r?;
            n += 1;
        }
        let read_s = t.elapsed().as_secs_f64();
        println!(
            "{class}: wrote {} MSR lines ({} MiB) in {gen_s:.2} s ({:.1} M lines/s); read back {n} in {read_s:.2} s ({:.1} M lines/s)",
            sum.written,
            size >> 20,
            sum.written as f64 / gen_s / 1e6,
            n as f64 / read_s / 1e6
        );
        std::fs::remove_file(&path)?;
    }

    let spec = WorkloadSpec {
        requests: requests / 5,
        ..WorkloadSpec::new(WorkloadClass::FileServer)
    };
    let path = dir.join("vdcache-eval-speed-fiu.txt");
    let t = Instant::now();
    let sum = write_workload(
        &spec,
        Format::Fiu,
        &WriterOptions::default(),
        BufWriter::new(File::create(&path)?),
    )?;
    let gen_s = t.elapsed().as_secs_f64();
    let t = Instant::now();
    let n = open_trace(&path, None)?.filter(|r| r.is_ok()).count();
    println!(
        "file-server FIU with digests: {} requests in {gen_s:.2} s; read back {n} lines in {:.2} s",
        sum.written,
        t.elapsed().as_secs_f64()
    );
    std::fs::remove_file(&path)?;

    let t = Instant::now();
    let n = generate(&WorkloadSpec {
        requests,
        content: false,
        ..WorkloadSpec::new(WorkloadClass::Oltp)
    })?
    .count();
    println!(
        "oltp generator alone: {n} records in {:.2} s",
        t.elapsed().as_secs_f64()
    );

    // FTL: 4 GiB logical, 4 KiB pages, 1 MiB erase blocks, 7% OP.
    let mut ftl = Ftl::new(FtlConfig::new(4 << 30, 4096, 1 << 20, 0.07))?;
    let pages = (4u64 << 30) / 4096;
    let t = Instant::now();
    ftl.write(0, 4 << 30)?;
    let seq_s = t.elapsed().as_secs_f64();
    let mut rng = Rng::seed_from_u64(1);
    let writes = 2 * pages;
    let t = Instant::now();
    for _ in 0..writes {
        ftl.write(rng.random_range(0..pages) * 4096, 4096)?;
    }
    let rnd_s = t.elapsed().as_secs_f64();
    let s = ftl.stats();
    println!(
        "FTL: sequential fill {:.1} M pages/s; random 4 KiB overwrites {:.1} M host pages/s ({:.1} M flash pages/s), WA of the random phase {:.2}, erases {}",
        pages as f64 / seq_s / 1e6,
        writes as f64 / rnd_s / 1e6,
        (s.flash_pages_written - pages) as f64 / rnd_s / 1e6,
        (s.flash_pages_written - pages) as f64 / writes as f64,
        s.erases
    );
    Ok(())
}
