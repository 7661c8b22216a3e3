//! How many CUDA processes of one container the gate lets through. MPS limits are per process
//! (measured: four processes of 3500 MiB in one 4Gi container had 14000 MiB), so a container's
//! memory limit is the total of at most `cuda_processes` processes, each given its share
//! (docs/adr/0006). Pure: liveness is asked of the caller.
//!
//! A process is counted from the moment it is let through (reserved) until it exits; the
//! same process may connect again (a CUDA client opens a second channel, a new context after a
//! reset) without counting twice, up to [`MAX_CHANNELS_PER_PROCESS`] channels: a CUDA client
//! takes two per context (measured), and every channel a process holds may be a client slot of
//! the GPU's one server, which all pods share.

use crate::process_identity::ProcessIdentity;

/// Channels one process may get from the daemon in its life: two per CUDA context (measured),
/// with room for re-created contexts.
pub const MAX_CHANNELS_PER_PROCESS: u32 = 8;

/// What the gate does with a process that asks for its channel.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Decision {
    /// Already counted: let it through.
    Known,
    /// Counted now (reserved); confirm it once it has its channel, or release it.
    Reserved,
    /// The container already has `limit` live processes on the server.
    OverBudget { limit: u32, live: Vec<u32> },
    /// The process already got [`MAX_CHANNELS_PER_PROCESS`] channels.
    TooManyChannels { channels: u32 },
}

#[derive(Debug, Clone, Default)]
pub struct ProcessBudget {
    limit: u32,
    /// Processes with a channel (or reserved for one), alive when last looked at.
    counted: Vec<Counted>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Counted {
    who: ProcessIdentity,
    confirmed: bool,
    channels: u32,
    /// Requests let through and not yet confirmed or released: they count against the channel
    /// cap, and an unconfirmed process stays counted while any is pending.
    pending: u32,
}

impl ProcessBudget {
    pub fn new(limit: u32) -> Self {
        ProcessBudget {
            limit: limit.max(1),
            counted: Vec::new(),
        }
    }

    pub fn limit(&self) -> u32 {
        self.limit
    }

    /// Decides for `who`; processes for which `alive` is false no longer count.
    pub fn decide(&mut self, who: ProcessIdentity, alive: impl Fn(&ProcessIdentity) -> bool) -> Decision {
        self.counted.retain(|c| alive(&c.who));
        if let Some(c) = self.counted.iter_mut().find(|c| c.who == who) {
            if c.channels + c.pending >= MAX_CHANNELS_PER_PROCESS {
                return Decision::TooManyChannels {
                    channels: c.channels + c.pending,
                };
            }
            c.pending += 1;
            return Decision::Known;
        }
        if self.counted.len() >= self.limit as usize {
            return Decision::OverBudget {
                limit: self.limit,
                live: self.counted.iter().map(|c| c.who.pid).collect(),
            };
        }
        self.counted.push(Counted {
            who,
            confirmed: false,
            channels: 0,
            pending: 1,
        });
        Decision::Reserved
    }

    /// A request let through by [`ProcessBudget::decide`] got a channel: the process counts
    /// until it exits (also if its entry went meanwhile: it holds a channel now).
    pub fn confirm(&mut self, who: ProcessIdentity) {
        match self.counted.iter_mut().find(|c| c.who == who) {
            Some(c) => {
                c.confirmed = true;
                c.channels += 1;
                c.pending = c.pending.saturating_sub(1);
            }
            None => self.counted.push(Counted {
                who,
                confirmed: true,
                channels: 1,
                pending: 0,
            }),
        }
    }

    /// A process that was on the server before this gate opened (a restarted manager found it
    /// among the server's clients): it counts, as if it had got its two channels here.
    pub fn seed(&mut self, who: ProcessIdentity) {
        if !self.counted.iter().any(|c| c.who == who) {
            self.counted.push(Counted {
                who,
                confirmed: true,
                channels: 2,
                pending: 0,
            });
        }
    }

    /// A request let through by [`ProcessBudget::decide`] that did not get a channel (the
    /// client left, the daemon refused): a process without a channel and without another
    /// request in flight no longer counts.
    pub fn release(&mut self, who: ProcessIdentity) {
        if let Some(c) = self.counted.iter_mut().find(|c| c.who == who) {
            c.pending = c.pending.saturating_sub(1);
        }
        self.counted
            .retain(|c| c.who != who || c.confirmed || c.pending > 0);
    }

    /// The pids of the processes with a channel, alive now.
    pub fn admitted(&mut self, alive: impl Fn(&ProcessIdentity) -> bool) -> Vec<u32> {
        self.counted.retain(|c| alive(&c.who));
        self.counted
            .iter()
            .filter(|c| c.confirmed)
            .map(|c| c.who.pid)
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use std::cell::RefCell;
    use std::collections::HashSet;

    use super::*;

    fn p(pid: u32) -> ProcessIdentity {
        ProcessIdentity {
            pid,
            start_ticks: 1000 + u64::from(pid),
        }
    }

    #[test]
    fn at_most_the_limit_and_the_same_process_counts_once() {
        let mut b = ProcessBudget::new(2);
        let all = |_: &ProcessIdentity| true;
        assert_eq!(b.decide(p(1), all), Decision::Reserved);
        b.confirm(p(1));
        assert_eq!(b.decide(p(1), all), Decision::Known, "its second channel");
        assert_eq!(b.decide(p(2), all), Decision::Reserved);
        assert_eq!(
            b.decide(p(3), all),
            Decision::OverBudget {
                limit: 2,
                live: vec![1, 2]
            }
        );
        assert_eq!(b.admitted(all), vec![1], "2 is reserved, not confirmed");
    }

    #[test]
    fn a_request_in_flight_keeps_a_process_counted() {
        // Two requests of one process in flight; the first one's client leaves, the second is
        // admitted: the process must still count (it holds a channel).
        let mut b = ProcessBudget::new(1);
        let all = |_: &ProcessIdentity| true;
        assert_eq!(b.decide(p(1), all), Decision::Reserved);
        assert_eq!(b.decide(p(1), all), Decision::Known);
        b.release(p(1));
        assert!(
            matches!(b.decide(p(2), all), Decision::OverBudget { .. }),
            "request b is in flight"
        );
        b.confirm(p(1));
        assert!(matches!(b.decide(p(2), all), Decision::OverBudget { .. }));
        assert_eq!(b.admitted(all), vec![1]);
        // Released entirely, then admitted: confirm puts it back.
        let mut b = ProcessBudget::new(1);
        assert_eq!(b.decide(p(3), all), Decision::Reserved);
        b.release(p(3));
        b.confirm(p(3));
        assert!(matches!(b.decide(p(4), all), Decision::OverBudget { .. }));
    }

    #[test]
    fn requests_in_flight_count_against_the_channel_cap() {
        let mut b = ProcessBudget::new(1);
        let all = |_: &ProcessIdentity| true;
        assert_eq!(b.decide(p(1), all), Decision::Reserved);
        for _ in 1..MAX_CHANNELS_PER_PROCESS {
            assert_eq!(b.decide(p(1), all), Decision::Known);
        }
        assert!(matches!(b.decide(p(1), all), Decision::TooManyChannels { .. }));
    }

    #[test]
    fn a_process_gets_a_bounded_number_of_channels() {
        let mut b = ProcessBudget::new(1);
        let all = |_: &ProcessIdentity| true;
        assert_eq!(b.decide(p(1), all), Decision::Reserved);
        b.confirm(p(1));
        for _ in 1..MAX_CHANNELS_PER_PROCESS {
            assert_eq!(b.decide(p(1), all), Decision::Known);
            b.confirm(p(1));
        }
        assert_eq!(
            b.decide(p(1), all),
            Decision::TooManyChannels {
                channels: MAX_CHANNELS_PER_PROCESS
            }
        );
    }

    #[test]
    fn processes_found_on_the_server_count_after_a_restart() {
        let mut b = ProcessBudget::new(1);
        let all = |_: &ProcessIdentity| true;
        b.seed(p(1));
        b.seed(p(1));
        assert!(matches!(b.decide(p(2), all), Decision::OverBudget { .. }));
        assert_eq!(b.decide(p(1), all), Decision::Known);
        assert_eq!(b.admitted(all), vec![1]);
    }

    #[test]
    fn a_process_that_exited_frees_its_place() {
        let mut b = ProcessBudget::new(1);
        let dead = RefCell::new(HashSet::new());
        let alive = |x: &ProcessIdentity| !dead.borrow().contains(&x.pid);
        assert_eq!(b.decide(p(1), alive), Decision::Reserved);
        b.confirm(p(1));
        assert!(matches!(b.decide(p(2), alive), Decision::OverBudget { .. }));
        dead.borrow_mut().insert(1);
        assert_eq!(b.decide(p(2), alive), Decision::Reserved);
    }

    #[test]
    fn a_recycled_pid_is_another_process() {
        let mut b = ProcessBudget::new(1);
        let all = |_: &ProcessIdentity| true;
        assert_eq!(b.decide(p(1), all), Decision::Reserved);
        b.confirm(p(1));
        let recycled = ProcessIdentity {
            pid: 1,
            start_ticks: 5,
        };
        assert!(matches!(b.decide(recycled, all), Decision::OverBudget { .. }));
    }

    #[test]
    fn a_released_reservation_frees_its_place_but_a_confirmed_one_stays() {
        let mut b = ProcessBudget::new(1);
        let all = |_: &ProcessIdentity| true;
        assert_eq!(b.decide(p(1), all), Decision::Reserved);
        b.release(p(1));
        assert_eq!(b.decide(p(2), all), Decision::Reserved);
        b.confirm(p(2));
        b.release(p(2));
        assert_eq!(b.decide(p(2), all), Decision::Known);
        assert_eq!(ProcessBudget::new(0).limit(), 1);
    }
}
