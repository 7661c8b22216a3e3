//! `<log dir>/control.log`: the banner that says this is a fake, then one timestamped line per
//! event, in the shape of the real log: `[2026-12-03 08:17:11.950 Control   481] NEW UI`.

use std::fs::{File, OpenOptions};
use std::io::Write;
use std::path::Path;
use std::sync::Mutex;
use std::time::{SystemTime, UNIX_EPOCH};

pub const BANNER: &str = "FAKE nvidia-cuda-mps-control (gpu-mps test double; no GPU, no MPS)";

pub struct ControlLog {
    file: Mutex<File>,
    pid: u32,
}

impl ControlLog {
    /// Opens the log for appending (the real daemon appends across restarts) and writes the banner.
    pub fn open(path: &Path) -> std::io::Result<ControlLog> {
        let mut file = OpenOptions::new().create(true).append(true).open(path)?;
        writeln!(file, "{BANNER}")?;
        Ok(ControlLog {
            file: Mutex::new(file),
            pid: std::process::id(),
        })
    }

    /// Writes each line of `text` with the timestamp prefix. Logging never fails the daemon.
    pub fn line(&self, text: &str) {
        let prefix = format!("[{} Control {:>5}]", timestamp(SystemTime::now()), self.pid);
        let mut out = String::new();
        for l in text.lines() {
            out.push_str(&format!("{prefix} {l}\n"));
        }
        if let Ok(mut file) = self.file.lock() {
            let _ = file.write_all(out.as_bytes());
        }
    }
}

/// `YYYY-MM-DD HH:MM:SS.mmm` in UTC.
fn timestamp(t: SystemTime) -> String {
    let since = t.duration_since(UNIX_EPOCH).unwrap_or_default();
    let secs = since.as_secs();
    let (y, m, d) = civil_from_days((secs / 86_400) as i64);
    let rem = secs % 86_400;
    format!(
        "{y:04}-{m:02}-{d:02} {:02}:{:02}:{:02}.{:03}",
        rem / 3600,
        rem / 60 % 60,
        rem % 60,
        since.subsec_millis()
    )
}

/// Days since 1970-01-01 to a proleptic Gregorian date (the well-known era/day-of-era method).
fn civil_from_days(days: i64) -> (i64, u32, u32) {
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = (doy - (153 * mp + 2) / 5 + 1) as u32;
    let m = if mp < 10 { mp + 3 } else { mp - 9 } as u32;
    let y = yoe + era * 400 + i64::from(m <= 2);
    (y, m, d)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    #[test]
    fn timestamps_are_utc_calendar_times() {
        assert_eq!(timestamp(UNIX_EPOCH), "1970-01-01 00:00:00.000");
        // 2026-12-03 08:17:11.950 UTC
        let t = UNIX_EPOCH + Duration::from_millis(1_796_285_831_950);
        assert_eq!(timestamp(t), "2026-12-03 08:17:11.950");
        let leap = UNIX_EPOCH + Duration::from_secs(951_782_400); // 2000-02-29
        assert_eq!(timestamp(leap), "2000-02-29 00:00:00.000");
    }
}
