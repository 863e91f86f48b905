//! Size arguments with qemu's suffixes (k, M, G, T, P, E; powers of 1024;
//! `b` for bytes), decimal fractions ("1.5M") and hexadecimal ("0x1000").

use anyhow::{Context, Result, bail};

/// Parses a size such as "4k", "1.5M", "0x10000" or "512".
pub fn parse_size(s: &str) -> Result<u64> {
    let t = s.trim();
    if t.is_empty() {
        bail!("empty size");
    }
    if t.starts_with('-') {
        bail!("invalid size '{s}': a size cannot be negative");
    }
    if let Some(hex) = t.strip_prefix("0x").or_else(|| t.strip_prefix("0X")) {
        return u64::from_str_radix(hex, 16)
            .with_context(|| format!("invalid hexadecimal size '{s}'"));
    }
    let split = t
        .find(|c: char| !(c.is_ascii_digit() || c == '.'))
        .unwrap_or(t.len());
    let (num, suffix) = t.split_at(split);
    let shift = match suffix {
        "" | "b" | "B" => 0,
        "k" | "K" => 10,
        "m" | "M" => 20,
        "g" | "G" => 30,
        "t" | "T" => 40,
        "p" | "P" => 50,
        "e" | "E" => 60,
        _ => bail!("invalid size '{s}': unknown suffix '{suffix}' (use k, M, G, T, P or E)"),
    };
    let (int_part, frac_part) = match num.split_once('.') {
        Some((i, f)) => (i, f),
        None => (num, ""),
    };
    if int_part.is_empty() && frac_part.is_empty() {
        bail!("invalid size '{s}': no digits");
    }
    let int: u64 = if int_part.is_empty() {
        0
    } else {
        int_part
            .parse()
            .with_context(|| format!("invalid size '{s}'"))?
    };
    let whole = int
        .checked_mul(1u64 << shift)
        .with_context(|| format!("size '{s}' is too large"))?;
    if frac_part.is_empty() {
        return Ok(whole);
    }
    if frac_part.len() > 18 {
        bail!("invalid size '{s}': too many decimals");
    }
    let frac: u128 = frac_part
        .parse()
        .with_context(|| format!("invalid size '{s}'"))?;
    let scale = 10u128.pow(frac_part.len() as u32);
    let scaled = frac * (1u128 << shift);
    if !scaled.is_multiple_of(scale) {
        bail!("invalid size '{s}': not a whole number of bytes");
    }
    whole
        .checked_add((scaled / scale) as u64)
        .with_context(|| format!("size '{s}' is too large"))
}

/// Formats bytes the way qemu-img prints sizes ("1 GiB", "64 KiB").
pub fn human(bytes: u64) -> String {
    const UNITS: [&str; 7] = ["B", "KiB", "MiB", "GiB", "TiB", "PiB", "EiB"];
    let mut v = bytes as f64;
    let mut i = 0;
    while v >= 1024.0 && i < UNITS.len() - 1 {
        v /= 1024.0;
        i += 1;
    }
    if i == 0 {
        format!("{bytes} B")
    } else if v.fract() == 0.0 {
        format!("{v:.0} {}", UNITS[i])
    } else {
        format!("{v:.3} {}", UNITS[i])
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn suffixes_fractions_and_hex() {
        assert_eq!(parse_size("512").unwrap(), 512);
        assert_eq!(parse_size("4k").unwrap(), 4096);
        assert_eq!(parse_size("4K").unwrap(), 4096);
        assert_eq!(parse_size("1.5M").unwrap(), 1536 << 10);
        assert_eq!(parse_size("0x1000").unwrap(), 4096);
        assert_eq!(parse_size("2G").unwrap(), 2 << 30);
        assert!(parse_size("16E").is_err());
        assert!(parse_size("1.1b").is_err());
        assert!(parse_size("4q").is_err());
        assert!(parse_size("").is_err());
        assert!(parse_size("k").is_err());
    }

    #[test]
    fn human_sizes() {
        assert_eq!(human(1 << 30), "1 GiB");
        assert_eq!(human(100), "100 B");
        assert_eq!(human(1536), "1.500 KiB");
    }
}
