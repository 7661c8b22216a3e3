//! Kubernetes resource quantities (`4Gi`, `512Mi`, `8G`, `1.5Gi`, `4294967296`) as bytes.
//!
//! Only what makes sense for a memory size is accepted: no negative values and no milli
//! suffix (`m`), which Kubernetes allows for CPU but which would mean thousandths of a byte.

use thiserror::Error;

/// The suffixes [`parse_bytes`] accepts and what each multiplies by: the one list both the
/// parser and its messages use. An exponent (`4e9`) is accepted too.
const SUFFIXES: [(&str, u128); 10] = [
    ("Ki", 1 << 10),
    ("Mi", 1 << 20),
    ("Gi", 1 << 30),
    ("Ti", 1 << 40),
    ("Pi", 1 << 50),
    ("k", 1_000),
    ("M", 1_000_000),
    ("G", 1_000_000_000),
    ("T", 1_000_000_000_000),
    ("P", 1_000_000_000_000_000),
];

/// `Ki, Mi, ..., P`: what an operator may write after the number, for the messages.
fn suffix_list() -> String {
    SUFFIXES.map(|(suffix, _)| suffix).join(", ")
}

#[derive(Debug, Error, PartialEq, Eq)]
pub enum QuantityError {
    #[error(
        "{value:?} is not a quantity: expected a number with an optional suffix ({}) or exponent (e9), e.g. 4Gi",
        suffix_list()
    )]
    Malformed { value: String },
    #[error(
        "{value:?} has unknown suffix {suffix:?}: allowed are {}, or an exponent such as e9",
        suffix_list()
    )]
    UnknownSuffix { value: String, suffix: String },
    #[error("{value:?} is too large: a quantity is at most {} bytes (2^64 - 1)", u64::MAX)]
    Overflow { value: String },
    #[error("{value:?} is not a whole number of bytes")]
    Fractional { value: String },
}

/// Parses a Kubernetes quantity into bytes.
pub fn parse_bytes(value: &str) -> Result<u64, QuantityError> {
    let trimmed = value.trim();
    let malformed = || QuantityError::Malformed {
        value: value.to_string(),
    };
    let split = trimmed
        .find(|c: char| !(c.is_ascii_digit() || c == '.'))
        .unwrap_or(trimmed.len());
    let (number, suffix) = trimmed.split_at(split);
    if number.is_empty()
        || number.starts_with('.')
        || number.ends_with('.')
        || number.matches('.').count() > 1
    {
        return Err(malformed());
    }
    let listed = SUFFIXES
        .iter()
        .find(|(name, _)| *name == suffix)
        .map(|(_, size)| *size);
    let multiplier: u128 = match (suffix, listed) {
        ("", _) => 1,
        (_, Some(size)) => size,
        (s, None)
            if s.starts_with(['e', 'E']) && s.len() > 1 && s[1..].chars().all(|c| c.is_ascii_digit()) =>
        {
            let exp: u32 = s[1..].parse().map_err(|_| malformed())?;
            10u128.checked_pow(exp).ok_or_else(|| QuantityError::Overflow {
                value: value.to_string(),
            })?
        }
        (s, None) => {
            return Err(QuantityError::UnknownSuffix {
                value: value.to_string(),
                suffix: s.to_string(),
            });
        }
    };
    let (whole, fraction) = number.split_once('.').unwrap_or((number, ""));
    let overflow = || QuantityError::Overflow {
        value: value.to_string(),
    };
    let whole: u128 = whole.parse().map_err(|_| overflow())?;
    let mut bytes = whole.checked_mul(multiplier).ok_or_else(overflow)?;
    if !fraction.is_empty() {
        // Exact decimal arithmetic: 1.5Gi must be exactly 1610612736, never a float rounding.
        let digits = u32::try_from(fraction.len()).map_err(|_| malformed())?;
        let scale = 10u128.checked_pow(digits).ok_or_else(overflow)?;
        let frac: u128 = fraction.parse().map_err(|_| malformed())?;
        let scaled = frac.checked_mul(multiplier).ok_or_else(overflow)?;
        if scaled % scale != 0 {
            return Err(QuantityError::Fractional {
                value: value.to_string(),
            });
        }
        bytes = bytes.checked_add(scaled / scale).ok_or_else(overflow)?;
    }
    u64::try_from(bytes).map_err(|_| overflow())
}

/// Formats bytes the way an operator reads them: the largest binary unit that divides evenly.
pub fn format_bytes(bytes: u64) -> String {
    const UNITS: [(&str, u64); 5] = [
        ("Pi", 1 << 50),
        ("Ti", 1 << 40),
        ("Gi", 1 << 30),
        ("Mi", 1 << 20),
        ("Ki", 1 << 10),
    ];
    for (suffix, size) in UNITS {
        if bytes >= size && bytes % size == 0 {
            return format!("{}{suffix}", bytes / size);
        }
    }
    bytes.to_string()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn both_messages_list_every_suffix_the_parser_accepts() {
        let malformed = parse_bytes("lots").unwrap_err().to_string();
        let unknown = parse_bytes("4GB").unwrap_err().to_string();
        for (suffix, size) in SUFFIXES {
            // Accepted...
            assert_eq!(
                u128::from(parse_bytes(&format!("2{suffix}")).unwrap()),
                2 * size,
                "{suffix}"
            );
            // ...and named in both messages.
            for message in [&malformed, &unknown] {
                assert!(
                    message.split(['(', ')', ',', ' ']).any(|word| word == suffix),
                    "{suffix} missing from {message}"
                );
            }
        }
        assert_eq!(parse_bytes("4e9"), Ok(4_000_000_000));
        assert!(malformed.contains("exponent (e9)") && unknown.contains("exponent such as e9"));
        assert_eq!(
            unknown,
            "\"4GB\" has unknown suffix \"GB\": allowed are Ki, Mi, Gi, Ti, Pi, k, M, G, T, P, or an exponent such as e9"
        );
        assert_eq!(
            malformed,
            "\"lots\" is not a quantity: expected a number with an optional suffix (Ki, Mi, Gi, Ti, Pi, k, M, G, T, P) or exponent (e9), e.g. 4Gi"
        );
    }

    #[test]
    fn parses_kubernetes_quantities() {
        let cases: &[(&str, u64)] = &[
            ("4Gi", 4 << 30),
            ("512Mi", 512 << 20),
            ("1.5Gi", 3 << 29),
            ("8G", 8_000_000_000),
            ("100k", 100_000),
            ("4294967296", 4 << 30),
            ("1e9", 1_000_000_000),
            (" 2Gi ", 2 << 30),
            ("1Ti", 1 << 40),
        ];
        for (input, want) in cases {
            assert_eq!(parse_bytes(input), Ok(*want), "{input}");
        }
    }

    #[test]
    fn rejects_what_is_not_a_memory_size() {
        assert!(matches!(parse_bytes(""), Err(QuantityError::Malformed { .. })));
        assert!(matches!(
            parse_bytes("-4Gi"),
            Err(QuantityError::Malformed { .. })
        ));
        assert!(matches!(parse_bytes("Gi"), Err(QuantityError::Malformed { .. })));
        assert!(matches!(
            parse_bytes("4.Gi"),
            Err(QuantityError::Malformed { .. })
        ));
        assert!(matches!(
            parse_bytes("1.2.3Gi"),
            Err(QuantityError::Malformed { .. })
        ));
        assert!(matches!(
            parse_bytes("4GB"),
            Err(QuantityError::UnknownSuffix { .. })
        ));
        assert!(matches!(
            parse_bytes("500m"),
            Err(QuantityError::UnknownSuffix { .. })
        ));
        assert!(matches!(
            parse_bytes("1.5"),
            Err(QuantityError::Fractional { .. })
        ));
        assert!(matches!(
            parse_bytes("99999999Pi"),
            Err(QuantityError::Overflow { .. })
        ));
    }

    #[test]
    fn error_names_the_value_and_what_is_allowed() {
        let msg = parse_bytes("4GB").unwrap_err().to_string();
        assert!(msg.contains("\"4GB\"") && msg.contains("Gi"), "{msg}");
        let msg = parse_bytes("16384Pi").unwrap_err().to_string();
        assert_eq!(
            msg,
            "\"16384Pi\" is too large: a quantity is at most 18446744073709551615 bytes (2^64 - 1)"
        );
    }

    #[test]
    fn formats_in_the_largest_even_unit() {
        assert_eq!(format_bytes(4 << 30), "4Gi");
        assert_eq!(format_bytes(1536 << 20), "1536Mi");
        assert_eq!(format_bytes(1000), "1000");
    }
}
