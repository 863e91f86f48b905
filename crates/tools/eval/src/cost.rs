//! Device cost model and latency accounting.
//!
//! This module owns two small things the replayer needs to report modelled
//! latency: named [`DeviceProfile`]s (a per-request latency, a positioning
//! time paid by non-sequential requests, a bandwidth, a flush cost) with the
//! service time they give an I/O, and a [`LatencyHistogram`] that keeps mean,
//! p50 and p99 in fixed memory.
//!
//! It must not model queueing, parallelism or caches inside the device: a
//! request's service time is `latency + positioning (unless sequential) +
//! bytes / bandwidth`, an open-loop cost, not a simulation. The numbers are
//! typical published figures for each class of device, chosen to rank
//! configurations, not to predict a particular product.

use std::fmt;
use std::str::FromStr;

use crate::trace::Op;

/// A class of storage device.
#[derive(Clone, Copy, Debug, PartialEq, serde::Serialize)]
pub struct DeviceProfile {
    pub name: &'static str,
    /// Fixed cost of a read: controller, protocol, media access (flash) or
    /// head settle and transfer start (disk).
    pub read_latency_ns: u64,
    /// Fixed cost of a write.
    pub write_latency_ns: u64,
    /// Seek plus rotational delay, paid by a request that does not start
    /// where the previous one on the same device ended (0 for flash).
    pub positioning_ns: u64,
    pub read_bytes_per_sec: u64,
    pub write_bytes_per_sec: u64,
    /// Cost of a cache flush.
    pub flush_ns: u64,
    /// Cost of a discard (any size).
    pub discard_ns: u64,
}

impl DeviceProfile {
    /// 7200 rpm SATA disk: average seek about 4 ms plus half a rotation
    /// (4.17 ms) = 8 ms positioning, 0.1 ms per request, 160 MB/s media rate,
    /// flush 10 ms (a rotation or so to drain the write cache).
    pub const HDD: DeviceProfile = DeviceProfile {
        name: "hdd",
        read_latency_ns: 100_000,
        write_latency_ns: 100_000,
        positioning_ns: 8_000_000,
        read_bytes_per_sec: 160_000_000,
        write_bytes_per_sec: 160_000_000,
        flush_ns: 10_000_000,
        discard_ns: 100_000,
    };

    /// SATA TLC SSD: 4 KiB read at queue depth 1 about 90 us, write 50 us
    /// (into the SLC/DRAM buffer), 540/500 MB/s (the 6 Gb/s link), flush
    /// 0.5 ms.
    pub const SATA_SSD: DeviceProfile = DeviceProfile {
        name: "sata-ssd",
        read_latency_ns: 90_000,
        write_latency_ns: 50_000,
        positioning_ns: 0,
        read_bytes_per_sec: 540_000_000,
        write_bytes_per_sec: 500_000_000,
        flush_ns: 500_000,
        discard_ns: 50_000,
    };

    /// PCIe 3.0 x4 NVMe TLC SSD: read 80 us, write 20 us, 3.5/3.0 GB/s, flush
    /// 0.1 ms.
    pub const NVME: DeviceProfile = DeviceProfile {
        name: "nvme",
        read_latency_ns: 80_000,
        write_latency_ns: 20_000,
        positioning_ns: 0,
        read_bytes_per_sec: 3_500_000_000,
        write_bytes_per_sec: 3_000_000_000,
        flush_ns: 100_000,
        discard_ns: 20_000,
    };

    /// Storage server over 10 GbE (NFS, iSCSI, NBD) with flash or a large
    /// cache behind it: 0.5 ms per request (round trip plus server), 1.1 GB/s
    /// (the link), flush 2 ms (server commits to stable storage).
    pub const NETWORK: DeviceProfile = DeviceProfile {
        name: "network",
        read_latency_ns: 500_000,
        write_latency_ns: 500_000,
        positioning_ns: 0,
        read_bytes_per_sec: 1_100_000_000,
        write_bytes_per_sec: 1_100_000_000,
        flush_ns: 2_000_000,
        discard_ns: 500_000,
    };

    /// All named profiles.
    pub const ALL: [DeviceProfile; 4] = [Self::HDD, Self::SATA_SSD, Self::NVME, Self::NETWORK];

    /// Service time of one request of `bytes`, assuming it is not sequential
    /// (pays positioning). Flush and discard costs ignore `bytes`.
    pub fn service_time_ns(&self, op: Op, bytes: u64) -> u64 {
        self.cost(op, bytes, false)
    }

    /// Service time, with `sequential` saying whether the request starts
    /// where the previous one ended.
    pub fn cost(&self, op: Op, bytes: u64, sequential: bool) -> u64 {
        let transfer = |bw: u64| -> u64 {
            if bw == 0 {
                return 0;
            }
            let ns = u128::from(bytes) * 1_000_000_000 / u128::from(bw);
            u64::try_from(ns).unwrap_or(u64::MAX)
        };
        let pos = if sequential { 0 } else { self.positioning_ns };
        match op {
            Op::Read => self
                .read_latency_ns
                .saturating_add(pos)
                .saturating_add(transfer(self.read_bytes_per_sec)),
            Op::Write => self
                .write_latency_ns
                .saturating_add(pos)
                .saturating_add(transfer(self.write_bytes_per_sec)),
            Op::Flush => self.flush_ns,
            Op::Discard => self.discard_ns,
        }
    }
}

impl FromStr for DeviceProfile {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s.to_ascii_lowercase().replace('_', "-").as_str() {
            "hdd" | "disk" => Ok(Self::HDD),
            "sata-ssd" | "ssd" | "sata" => Ok(Self::SATA_SSD),
            "nvme" => Ok(Self::NVME),
            "network" | "net" | "nfs" | "iscsi" => Ok(Self::NETWORK),
            _ => Err(format!(
                "unknown device profile '{s}' (expected hdd, sata-ssd, nvme or network)"
            )),
        }
    }
}

impl fmt::Display for DeviceProfile {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name)
    }
}

/// A profile plus the head position, so that sequential requests skip
/// positioning. One model per physical device.
#[derive(Clone, Debug)]
pub struct DeviceModel {
    pub profile: DeviceProfile,
    next_offset: Option<u64>,
    busy_ns: u64,
}

impl DeviceModel {
    pub fn new(profile: DeviceProfile) -> Self {
        DeviceModel {
            profile,
            next_offset: None,
            busy_ns: 0,
        }
    }

    /// Service time of a request at `offset`; updates the head position.
    pub fn service(&mut self, op: Op, offset: u64, len: u64) -> u64 {
        let t = match op {
            Op::Read | Op::Write => {
                let seq = self.next_offset == Some(offset);
                self.next_offset = Some(offset.saturating_add(len));
                self.profile.cost(op, len, seq)
            }
            Op::Flush | Op::Discard => self.profile.cost(op, len, true),
        };
        self.busy_ns = self.busy_ns.saturating_add(t);
        t
    }

    /// Sum of all service times so far.
    pub fn busy_ns(&self) -> u64 {
        self.busy_ns
    }
}

// ---------------------------------------------------------------------------

/// Values below this are counted exactly.
const EXACT: u64 = 128;
/// Sub-buckets per power of two above it (relative error <= 1/64).
const SUB_BITS: u32 = 6;
const SUB: u64 = 1 << SUB_BITS;
const BUCKETS: usize = EXACT as usize + (64 - 7) * SUB as usize;

/// Log-linear histogram of latencies in ns: exact below 128 ns, then 64
/// buckets per power of two (<= 1.6% relative error), up to u64::MAX, in a
/// fixed 29 KiB. Mean, min and max are exact.
#[derive(Clone)]
pub struct LatencyHistogram {
    counts: Box<[u64]>,
    count: u64,
    sum: u128,
    min: u64,
    max: u64,
}

impl Default for LatencyHistogram {
    fn default() -> Self {
        Self::new()
    }
}

impl fmt::Debug for LatencyHistogram {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("LatencyHistogram")
            .field("summary", &self.summary())
            .finish()
    }
}

fn bucket_of(v: u64) -> usize {
    if v < EXACT {
        return v as usize;
    }
    let e = 63 - v.leading_zeros(); // >= 7
    let mant = (v >> (e - SUB_BITS)) & (SUB - 1);
    EXACT as usize + (e as usize - 7) * SUB as usize + mant as usize
}

/// Smallest value in bucket `i`, and the bucket's width.
fn bucket_range(i: usize) -> (u64, u64) {
    if i < EXACT as usize {
        return (i as u64, 1);
    }
    let j = i - EXACT as usize;
    let e = 7 + (j / SUB as usize) as u32;
    let mant = (j % SUB as usize) as u64;
    let width = 1u64 << (e - SUB_BITS);
    ((1u64 << e) + mant * width, width)
}

/// Summary of a histogram, for reports.
#[derive(Clone, Copy, Debug, Default, PartialEq, serde::Serialize)]
pub struct LatencySummary {
    pub count: u64,
    pub mean_ns: f64,
    pub min_ns: u64,
    pub p50_ns: u64,
    pub p99_ns: u64,
    pub max_ns: u64,
}

impl LatencyHistogram {
    pub fn new() -> Self {
        LatencyHistogram {
            counts: vec![0; BUCKETS].into_boxed_slice(),
            count: 0,
            sum: 0,
            min: u64::MAX,
            max: 0,
        }
    }

    pub fn record(&mut self, ns: u64) {
        self.record_n(ns, 1);
    }

    /// Record `n` occurrences of `ns`.
    pub fn record_n(&mut self, ns: u64, n: u64) {
        if n == 0 {
            return;
        }
        self.counts[bucket_of(ns)] += n;
        self.count += n;
        self.sum += u128::from(ns) * u128::from(n);
        self.min = self.min.min(ns);
        self.max = self.max.max(ns);
    }

    pub fn merge(&mut self, other: &LatencyHistogram) {
        for (a, b) in self.counts.iter_mut().zip(other.counts.iter()) {
            *a += b;
        }
        self.count += other.count;
        self.sum += other.sum;
        self.min = self.min.min(other.min);
        self.max = self.max.max(other.max);
    }

    pub fn count(&self) -> u64 {
        self.count
    }

    /// Exact mean; 0 when empty.
    pub fn mean(&self) -> f64 {
        if self.count == 0 {
            0.0
        } else {
            self.sum as f64 / self.count as f64
        }
    }

    /// Nearest-rank percentile (`p` in [0, 100]): the value below which at
    /// least p% of the samples lie, as the middle of its bucket, clamped to
    /// [min, max]. 0 when empty.
    pub fn percentile(&self, p: f64) -> u64 {
        if self.count == 0 {
            return 0;
        }
        let p = if p.is_nan() {
            50.0
        } else {
            p.clamp(0.0, 100.0)
        };
        let rank = ((p / 100.0 * self.count as f64).ceil() as u64).clamp(1, self.count);
        let mut seen = 0;
        for (i, &c) in self.counts.iter().enumerate() {
            seen += c;
            if seen >= rank {
                let (lo, w) = bucket_range(i);
                return lo.saturating_add(w / 2).clamp(self.min, self.max);
            }
        }
        self.max
    }

    pub fn p50(&self) -> u64 {
        self.percentile(50.0)
    }

    pub fn p99(&self) -> u64 {
        self.percentile(99.0)
    }

    pub fn summary(&self) -> LatencySummary {
        LatencySummary {
            count: self.count,
            mean_ns: self.mean(),
            min_ns: if self.count == 0 { 0 } else { self.min },
            p50_ns: self.p50(),
            p99_ns: self.p99(),
            max_ns: self.max,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn profiles_give_documented_costs() {
        let hdd = DeviceProfile::HDD;
        // 4 KiB random read: 0.1 ms + 8 ms + 4096 / 160 MB/s (25.6 us).
        assert_eq!(
            hdd.service_time_ns(Op::Read, 4096),
            100_000 + 8_000_000 + 25_600
        );
        assert_eq!(hdd.cost(Op::Read, 4096, true), 125_600);
        assert_eq!(
            DeviceProfile::NVME.service_time_ns(Op::Write, 3_000_000_000),
            20_000 + 1_000_000_000
        );
        assert_eq!(
            DeviceProfile::NETWORK.service_time_ns(Op::Flush, 0),
            2_000_000
        );
        assert!(
            DeviceProfile::SATA_SSD.service_time_ns(Op::Read, 4096)
                < hdd.service_time_ns(Op::Read, 4096)
        );
        assert_eq!(
            hdd.service_time_ns(Op::Read, u64::MAX),
            u64::MAX,
            "saturates"
        );
        for p in DeviceProfile::ALL {
            assert_eq!(p.name.parse::<DeviceProfile>(), Ok(p));
        }
        assert!("tape".parse::<DeviceProfile>().is_err());
    }

    #[test]
    fn model_skips_positioning_when_sequential() {
        let mut m = DeviceModel::new(DeviceProfile::HDD);
        let first = m.service(Op::Read, 0, 4096);
        let second = m.service(Op::Read, 4096, 4096);
        let third = m.service(Op::Read, 1 << 30, 4096);
        assert_eq!(first, third);
        assert_eq!(first - second, 8_000_000);
        assert_eq!(m.busy_ns(), first + second + third);
    }

    #[test]
    fn bucket_bounds_are_consistent() {
        let mut last = None;
        for v in (0..5000u64).chain([1 << 20, (1 << 20) + 12345, u64::MAX / 3, u64::MAX]) {
            let b = bucket_of(v);
            assert!(b < BUCKETS);
            let (lo, w) = bucket_range(b);
            assert!(lo <= v && v - lo < w, "v {v} bucket {b} lo {lo} w {w}");
            if v > 0 && v < 5000 {
                assert!(Some(b) >= last);
            }
            last = Some(b);
        }
    }

    #[test]
    fn percentiles() {
        let mut h = LatencyHistogram::new();
        assert_eq!(h.summary(), LatencySummary::default());
        for v in 1..=100 {
            h.record(v);
        }
        assert_eq!(h.p50(), 50);
        assert_eq!(h.p99(), 99);
        assert_eq!(h.percentile(100.0), 100);
        assert!((h.mean() - 50.5).abs() < 1e-9);
        let mut big = LatencyHistogram::new();
        big.record_n(1_000_000, 990);
        big.record_n(50_000_000, 10);
        let p50 = big.p50() as f64;
        let p99 = big.p99() as f64;
        assert!((p50 - 1e6).abs() / 1e6 < 0.02, "p50 {p50}");
        assert!((p99 - 1e6).abs() / 1e6 < 0.02, "p99 {p99}");
        assert!((big.percentile(99.5) as f64 - 5e7).abs() / 5e7 < 0.02);
        let mut merged = h.clone();
        merged.merge(&big);
        assert_eq!(merged.count(), 1100);
        assert_eq!(merged.summary().max_ns, 50_000_000);
        assert_eq!(merged.summary().min_ns, 1);
    }
}
