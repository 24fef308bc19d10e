//! Byte counts on the command line: `65536`, `64K`, `64M`, `1G`, `4KiB`
//! (binary multiples), `1GB` / `500MB` (decimal ones).

/// Parses a byte count; the reason names what is wrong.
pub fn parse_size(text: &str) -> Result<u64, String> {
    let t = text.trim();
    let split = t.find(|c: char| !c.is_ascii_digit()).unwrap_or(t.len());
    let (digits, unit) = t.split_at(split);
    if digits.is_empty() {
        return Err(format!(
            "{text:?} is not a byte count (e.g. 65536, 64K, 64M, 1G)"
        ));
    }
    let n: u64 = digits
        .parse()
        .map_err(|_| format!("{text:?} is too large"))?;
    let scale: u64 = match unit {
        "" | "B" => 1,
        "K" | "k" | "KiB" => 1 << 10,
        "M" | "MiB" => 1 << 20,
        "G" | "GiB" => 1 << 30,
        "T" | "TiB" => 1 << 40,
        "kB" | "KB" => 1_000,
        "MB" => 1_000_000,
        "GB" => 1_000_000_000,
        "TB" => 1_000_000_000_000,
        other => {
            return Err(format!(
                "{text:?}: unknown unit {other:?} (K, M, G, T or KiB, MiB, GiB; KB, MB, GB are powers of 1000)"
            ));
        }
    };
    n.checked_mul(scale)
        .ok_or_else(|| format!("{text:?} is too large"))
}

/// `n` bytes for people: `4 KiB`, `16 MiB`, else `n B`.
pub fn human(n: u64) -> String {
    match n {
        n if n >= 1 << 30 && n % (1 << 30) == 0 => format!("{} GiB", n >> 30),
        n if n >= 1 << 20 && n % (1 << 20) == 0 => format!("{} MiB", n >> 20),
        n if n >= 1 << 10 && n % (1 << 10) == 0 => format!("{} KiB", n >> 10),
        n => format!("{n} B"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_take_binary_and_decimal_units() {
        assert_eq!(parse_size("65536"), Ok(65536));
        assert_eq!(parse_size("64K"), Ok(64 << 10));
        assert_eq!(parse_size("64M"), Ok(64 << 20));
        assert_eq!(parse_size("64MiB"), Ok(64 << 20));
        assert_eq!(parse_size("1G"), Ok(1 << 30));
        assert_eq!(parse_size("500MB"), Ok(500_000_000));
        assert_eq!(parse_size(" 4k "), Ok(4096));
        for bad in [
            "",
            "M",
            "64X",
            "-1",
            "1.5G",
            "99999999999999999999",
            "20000000T",
        ] {
            assert!(parse_size(bad).is_err(), "{bad:?} accepted");
        }
        assert_eq!(human(4096), "4 KiB");
        assert_eq!(human(16 << 20), "16 MiB");
        assert_eq!(human(1 << 30), "1 GiB");
        assert_eq!(human(1000), "1000 B");
    }
}
