//! Error lines in runc's `--log` format.
//!
//! containerd's runc shim passes `--log <bundle>/log.json --log-format json`, and when runc
//! fails it decodes that file line by line and returns the `msg` of the last `"level":"error"`
//! line to its caller (kubelet, ctr). It decodes `time` as an RFC 3339 timestamp: a line with
//! another time format would make it drop the message. So a shim error is written there, in
//! the same shape as runc's logrus lines, to reach the user.

use std::fs::OpenOptions;
use std::io::{self, Write};
use std::os::unix::fs::OpenOptionsExt;
use std::path::Path;
use std::time::{SystemTime, UNIX_EPOCH};

use crate::runc_args::LogFormat;

/// One error line (without the newline) in `format`; `time` is an RFC 3339 timestamp.
pub fn error_line(format: LogFormat, msg: &str, time: &str) -> String {
    log_line(format, "error", msg, time)
}

/// One line of `level` (logrus' names: error, debug) in `format`, without the newline.
pub fn log_line(format: LogFormat, level: &str, msg: &str, time: &str) -> String {
    // A log line must stay one line whatever an error message carries.
    let msg = gpu_mps_api::message::one_line(msg);
    match format {
        LogFormat::Json => serde_json::json!({ "level": level, "msg": msg, "time": time }).to_string(),
        LogFormat::Text => format!("time={} level={level} msg={}", go_quote(time), go_quote(&msg)),
    }
}

/// Appends one error line to the runc log file, as runc opens it (create, append, 0644).
pub fn append_error(path: &Path, format: LogFormat, msg: &str, now: SystemTime) -> io::Result<()> {
    append(path, format, "error", msg, now)
}

/// Appends one debug line to the runc log file. containerd returns only the last error line to
/// its caller; debug lines stay in the file, next to runc's own under `--debug`.
pub fn append_debug(path: &Path, format: LogFormat, msg: &str, now: SystemTime) -> io::Result<()> {
    append(path, format, "debug", msg, now)
}

fn append(path: &Path, format: LogFormat, level: &str, msg: &str, now: SystemTime) -> io::Result<()> {
    let mut line = log_line(format, level, msg, &rfc3339_utc(now));
    line.push('\n');
    let mut file = OpenOptions::new()
        .create(true)
        .append(true)
        .mode(0o644)
        .open(path)?;
    // One write call, so that a concurrent writer cannot split the line.
    file.write_all(line.as_bytes())
}

/// `2026-12-03T08:20:00Z`: RFC 3339 in UTC, to the second.
pub fn rfc3339_utc(t: SystemTime) -> String {
    let secs = t.duration_since(UNIX_EPOCH).map(|d| d.as_secs()).unwrap_or(0);
    let (days, rem) = (secs / 86_400, secs % 86_400);
    let (year, month, day) = civil_from_days(days);
    format!(
        "{year:04}-{month:02}-{day:02}T{:02}:{:02}:{:02}Z",
        rem / 3600,
        rem % 3600 / 60,
        rem % 60
    )
}

/// The proleptic Gregorian date of a day count since 1970-01-01 (counted in 400-year eras,
/// each starting on March 1st so that the leap day is the last day of its year).
fn civil_from_days(days: u64) -> (u64, u64, u64) {
    let z = days + 719_468;
    let era = z / 146_097;
    let day_of_era = z % 146_097;
    let year_of_era = (day_of_era - day_of_era / 1460 + day_of_era / 36_524 - day_of_era / 146_096) / 365;
    let day_of_year = day_of_era - (365 * year_of_era + year_of_era / 4 - year_of_era / 100);
    let month_from_march = (5 * day_of_year + 2) / 153;
    let day = day_of_year - (153 * month_from_march + 2) / 5 + 1;
    let month = if month_from_march < 10 {
        month_from_march + 3
    } else {
        month_from_march - 9
    };
    let year = year_of_era + era * 400 + u64::from(month <= 2);
    (year, month, day)
}

/// A double-quoted string as Go's `%q` writes it, which is how logrus' text format quotes.
fn go_quote(s: &str) -> String {
    let mut out = String::with_capacity(s.len() + 2);
    out.push('"');
    for c in s.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            c if (c as u32) < 0x20 || c == '\u{7f}' => out.push_str(&format!("\\x{:02x}", c as u32)),
            c => out.push(c),
        }
    }
    out.push('"');
    out
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;

    #[test]
    fn json_line_has_level_msg_and_time() {
        let line = error_line(LogFormat::Json, "gpu-mps: bad \"4GB\"", "2026-12-03T08:20:00Z");
        assert_eq!(
            line,
            r#"{"level":"error","msg":"gpu-mps: bad \"4GB\"","time":"2026-12-03T08:20:00Z"}"#
        );
        let v: serde_json::Value = serde_json::from_str(&line).unwrap();
        assert_eq!(v["msg"], "gpu-mps: bad \"4GB\"");
    }

    #[test]
    fn text_line_is_logrus_text() {
        let line = error_line(
            LogFormat::Text,
            "gpu-mps: annotation x=\"4GB\": \\ bad",
            "2026-12-03T08:20:00Z",
        );
        assert_eq!(
            line,
            r#"time="2026-12-03T08:20:00Z" level=error msg="gpu-mps: annotation x=\"4GB\": \\ bad""#
        );
    }

    #[test]
    fn lines_never_break() {
        for format in [LogFormat::Json, LogFormat::Text] {
            let line = error_line(format, "one\ntwo\r\nthree", "2026-12-03T08:20:00Z");
            assert!(!line.contains('\n') && !line.contains('\r'), "{line}");
        }
        assert_eq!(go_quote("a\u{1}b"), "\"a\\x01b\"");
    }

    #[test]
    fn rfc3339_in_utc() {
        let at = |secs: u64| rfc3339_utc(UNIX_EPOCH + Duration::from_secs(secs));
        assert_eq!(at(0), "1970-01-01T00:00:00Z");
        assert_eq!(at(951_782_400), "2000-02-29T00:00:00Z");
        assert_eq!(at(1_709_251_199), "2024-02-29T23:59:59Z");
        assert_eq!(at(1_796_286_000), "2026-12-03T08:20:00Z");
        assert_eq!(at(4_102_444_800), "2100-01-01T00:00:00Z");
    }

    #[test]
    fn appends_one_line_per_error() {
        let dir = tempfile::tempdir().unwrap();
        let log = dir.path().join("log.json");
        std::fs::write(
            &log,
            "{\"level\":\"info\",\"msg\":\"earlier\",\"time\":\"2026-01-01T00:00:00Z\"}\n",
        )
        .unwrap();
        append_error(&log, LogFormat::Json, "gpu-mps: boom", UNIX_EPOCH).unwrap();
        let text = std::fs::read_to_string(&log).unwrap();
        let lines: Vec<_> = text.lines().collect();
        assert_eq!(lines.len(), 2);
        assert_eq!(
            lines[1],
            r#"{"level":"error","msg":"gpu-mps: boom","time":"1970-01-01T00:00:00Z"}"#
        );
    }
}
