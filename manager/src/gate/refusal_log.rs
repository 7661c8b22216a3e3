//! Which of a gate's refusals reach the log. A process whose request is refused may retry it at
//! once, again and again: measured on the H200, one process refused for its channel count
//! retried 56 times in 5 ms, one WARN line each. The first refusal is logged; the same refusal
//! again within [`FOLD_WINDOW`] is only counted, and the count goes out with the next logged
//! line. A different refusal is always logged. Pure: the caller passes the time.

use std::time::{Duration, Instant};

/// How long the same refusal stays folded into a count before it is logged again.
pub const FOLD_WINDOW: Duration = Duration::from_secs(60);

#[derive(Debug, Default)]
pub struct RefusalLog {
    /// The last refusal logged, and when.
    last_logged: Option<(String, Instant)>,
    /// Refusals since then that were not logged.
    folded: u32,
}

impl RefusalLog {
    /// Notes a refusal. `Some(folded)`: log it, saying that `folded` refusals since the last
    /// logged line were not. `None`: it repeats the last logged one within the window.
    pub fn note(&mut self, refusal: &str, now: Instant) -> Option<u32> {
        if let Some((last, at)) = &self.last_logged {
            if last == refusal && now.saturating_duration_since(*at) < FOLD_WINDOW {
                self.folded = self.folded.saturating_add(1);
                return None;
            }
        }
        self.last_logged = Some((refusal.to_string(), now));
        Some(std::mem::take(&mut self.folded))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_refusal_repeated_at_once_is_logged_once_and_counted() {
        let mut log = RefusalLog::default();
        let t = Instant::now();
        assert_eq!(log.note("pid 7: too many channels", t), Some(0));
        for i in 1..=55 {
            assert_eq!(
                log.note("pid 7: too many channels", t + Duration::from_micros(i)),
                None
            );
        }
        // A different refusal is logged at once and carries the count of the folded ones.
        assert_eq!(
            log.note("pid 8: over budget", t + Duration::from_millis(5)),
            Some(55)
        );
        assert_eq!(log.note("pid 8: over budget", t + Duration::from_millis(6)), None);
    }

    #[test]
    fn the_same_refusal_is_logged_again_after_the_window() {
        let mut log = RefusalLog::default();
        let t = Instant::now();
        assert_eq!(log.note("pid 7: a UI session", t), Some(0));
        assert_eq!(
            log.note("pid 7: a UI session", t + FOLD_WINDOW - Duration::from_millis(1)),
            None
        );
        assert_eq!(log.note("pid 7: a UI session", t + FOLD_WINDOW), Some(1));
        assert_eq!(
            log.note("pid 7: a UI session", t + FOLD_WINDOW + Duration::from_secs(1)),
            None
        );
    }

    #[test]
    fn the_same_words_from_another_process_are_another_refusal() {
        let mut log = RefusalLog::default();
        let t = Instant::now();
        assert_eq!(log.note("pid 7: a UI session", t), Some(0));
        assert_eq!(log.note("pid 9: a UI session", t), Some(0));
        assert_eq!(log.note("pid 7: a UI session", t), Some(0));
    }
}
