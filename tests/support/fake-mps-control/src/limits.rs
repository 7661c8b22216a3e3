//! The text forms of MPS limits, as `nvidia-cuda-mps-control` reads and prints them
//! (measured on the H200, driver 580: docs/gpu-runs/2026-12-03-probe.log).

/// A thread percentage as the real CLI prints it: `25.0`, `100.0`.
pub fn format_threads(percentage: f64) -> String {
    format!("{percentage:.1}")
}

/// A thread percentage the daemon accepts, or `None` when it keeps the old value.
///
/// Measured: 25 is taken, 250 is refused (the old value is echoed). Not measured: 0, negative
/// and non-numeric values; the fake refuses them the same way, since MPS documents 1-100.
pub fn parse_threads(text: &str) -> Option<f64> {
    let value: f64 = text.trim().parse().ok()?;
    (value.is_finite() && value > 0.0 && value <= 100.0).then_some(value)
}

/// A pinned memory limit in MiB from `<int>M` or `<int>G` (G = GiB), the forms MPS documents.
/// Lower-case suffixes are accepted too (not measured on the real one).
pub fn parse_mem_mib(text: &str) -> Option<u64> {
    let text = text.trim();
    let (number, factor) = match text.strip_suffix(['G', 'g']) {
        Some(n) => (n, 1024),
        None => (text.strip_suffix(['M', 'm'])?, 1),
    };
    if number.is_empty() || !number.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    number.parse::<u64>().ok()?.checked_mul(factor)
}

/// A pinned memory limit as the real CLI prints it (measured on the H200): from 1 GiB up in
/// whole GiB, rounded down (`1040M` and `1960M` print `1G`, `4096M` prints `4G`), below in MiB
/// (`1020M`). An unset limit prints `0`: what the real one prints there was NOT measured.
pub fn format_mem_mib_as_cli(mib: u64) -> String {
    match mib {
        0 => "0".to_string(),
        1..1024 => format!("{mib}M"),
        _ => format!("{}G", mib / 1024),
    }
}

/// A limit exactly, in the fake's own answer to a client: whole GiB as `4G`, else `3000M`.
pub fn format_mem_mib(mib: u64) -> String {
    let (gib, rest) = (mib / 1024, mib % 1024);
    if mib == 0 {
        "0".to_string()
    } else if rest == 0 {
        format!("{gib}G")
    } else {
        format!("{mib}M")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn threads_print_with_one_decimal() {
        assert_eq!(format_threads(25.0), "25.0");
        assert_eq!(format_threads(100.0), "100.0");
        assert_eq!(format_threads(12.5), "12.5");
    }

    #[test]
    fn threads_out_of_range_are_refused() {
        assert_eq!(parse_threads("25"), Some(25.0));
        assert_eq!(parse_threads("100"), Some(100.0));
        assert_eq!(parse_threads("12.5"), Some(12.5));
        for bad in ["250", "0", "-5", "abc", "", "NaN", "inf"] {
            assert_eq!(parse_threads(bad), None, "{bad}");
        }
    }

    #[test]
    fn memory_reads_m_and_g() {
        assert_eq!(parse_mem_mib("4096M"), Some(4096));
        assert_eq!(parse_mem_mib("4G"), Some(4096));
        assert_eq!(parse_mem_mib("3000m"), Some(3000));
        for bad in ["4096", "G", "4.5G", "-1G", "4T", "", "99999999999999999999G"] {
            assert_eq!(parse_mem_mib(bad), None, "{bad}");
        }
    }

    #[test]
    fn memory_prints_whole_gib_as_g() {
        assert_eq!(format_mem_mib(4096), "4G");
        assert_eq!(format_mem_mib(8192), "8G");
        assert_eq!(format_mem_mib(3000), "3000M");
        assert_eq!(format_mem_mib(0), "0");
        for (mib, printed) in [
            (1020, "1020M"),
            (1040, "1G"),
            (1960, "1G"),
            (3000, "2G"),
            (4096, "4G"),
            (0, "0"),
        ] {
            assert_eq!(format_mem_mib_as_cli(mib), printed);
        }
    }
}
