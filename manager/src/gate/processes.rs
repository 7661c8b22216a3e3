//! How many CUDA processes of one container the gate lets through. MPS limits are per process
//! (measured: four processes of 3500 MiB in one 4Gi container had 14000 MiB), so a container's
//! memory limit is the total of at most `cuda_processes` processes, each given its share
//! (docs/adr/0006). Pure: liveness is asked of the caller.
//!
//! A process is counted from the moment it is let through (reserved) until it has exited AND
//! its GPU's MPS server no longer lists it: a process may pass its channel to another process
//! and exit (a relay, docs/security.md), and MPS does not tie a client to the process that
//! connected (measured, MPS-FACTS "Hostile tenants"), so what the server holds counts, not only
//! what /proc shows. The server's clients found in the container's cgroup count too, whoever
//! connected for them. The same process may connect again (a CUDA client opens a second channel, a new context after a
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
    /// The container already has `limit` processes that hold a place. `lingering`: some of
    /// them have exited and the server still lists them (it lets a client go a moment after
    /// the process ends): worth asking again shortly before refusing.
    OverBudget {
        limit: u32,
        live: Vec<u32>,
        lingering: bool,
    },
    /// The process already got [`MAX_CHANNELS_PER_PROCESS`] channels.
    TooManyChannels { channels: u32 },
}

/// The clients the container's GPU's MPS servers list right now (host pids), as the daemon's
/// `get_client_list` answers: what the server holds, whoever connected for it.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ServerClients {
    /// Every client of the daemon's servers.
    pub listed: Vec<u32>,
    /// Those of them that run in the container's cgroup (or below it).
    pub in_container: Vec<u32>,
}

impl ServerClients {
    fn lists(&self, pid: u32) -> bool {
        self.listed.contains(&pid)
    }
}

#[derive(Debug, Clone, Default)]
pub struct ProcessBudget {
    limit: u32,
    /// Processes with a channel (or reserved for one), alive or listed by the server when last
    /// looked at.
    counted: Vec<Counted>,
    /// The server's clients at the last look, so that a view between two decisions does not
    /// drop a process whose channel another process now holds.
    server: ServerClients,
    /// A channel was issued through this gate, or a process of the container was found on the
    /// server: only then can the server hold a client of the container that nobody here counts.
    issued: bool,
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
            server: ServerClients::default(),
            issued: false,
        }
    }

    pub fn limit(&self) -> u32 {
        self.limit
    }

    /// True if `who` is counted already: its next channel needs no look at the server.
    pub fn knows(&self, who: ProcessIdentity) -> bool {
        self.counted.iter().any(|c| c.who == who)
    }

    /// True when deciding for a new process needs a look at the server: some channel was
    /// issued since the gate opened (or the container had processes on the server then). The
    /// first process of a container pays nothing for it.
    pub fn needs_server_view(&self) -> bool {
        self.issued
    }

    /// Decides for `who`, given what the server lists now (`server`; `None`: as at the last
    /// look, for a process already counted). A counted process stops counting once `alive` is
    /// false for it and the server no longer lists it; the server's clients in the container's
    /// cgroup that nobody here counts take a place each.
    pub fn decide(
        &mut self,
        who: ProcessIdentity,
        alive: impl Fn(&ProcessIdentity) -> bool,
        server: Option<ServerClients>,
    ) -> Decision {
        if let Some(server) = server {
            self.server = server;
        }
        self.forget_gone(&alive);
        if let Some(c) = self.counted.iter_mut().find(|c| c.who == who) {
            if c.channels + c.pending >= MAX_CHANNELS_PER_PROCESS {
                return Decision::TooManyChannels {
                    channels: c.channels + c.pending,
                };
            }
            c.pending += 1;
            return Decision::Known;
        }
        let holders = self.holders();
        if holders.len() >= self.limit as usize {
            return Decision::OverBudget {
                limit: self.limit,
                live: holders,
                lingering: self.counted.iter().any(|c| !alive(&c.who)),
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

    /// Drops the processes that are gone and that the server no longer lists.
    fn forget_gone(&mut self, alive: &impl Fn(&ProcessIdentity) -> bool) {
        let server = &self.server;
        self.counted.retain(|c| alive(&c.who) || server.lists(c.who.pid));
    }

    /// The pids that take a place: the processes counted here and the server's clients in the
    /// container that are not among them.
    fn holders(&self) -> Vec<u32> {
        let mut pids: Vec<u32> = self.counted.iter().map(|c| c.who.pid).collect();
        for pid in &self.server.in_container {
            if !pids.contains(pid) {
                pids.push(*pid);
            }
        }
        pids
    }

    /// A request let through by [`ProcessBudget::decide`] got a channel: the process counts
    /// until it exits (also if its entry went meanwhile: it holds a channel now).
    pub fn confirm(&mut self, who: ProcessIdentity) {
        self.issued = true;
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
        self.issued = true;
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

    /// The pids that hold a place with a channel: the confirmed processes alive now or listed
    /// by the server at the last look, and the server's clients in the container then.
    pub fn admitted(&mut self, alive: impl Fn(&ProcessIdentity) -> bool) -> Vec<u32> {
        self.forget_gone(&alive);
        let mut pids: Vec<u32> = self
            .counted
            .iter()
            .filter(|c| c.confirmed)
            .map(|c| c.who.pid)
            .collect();
        for pid in &self.server.in_container {
            if !pids.contains(pid) && !self.counted.iter().any(|c| c.who.pid == *pid) {
                pids.push(*pid);
            }
        }
        pids
    }
}

#[cfg(test)]
mod tests {
    use std::cell::RefCell;
    use std::collections::HashSet;

    use super::*;

    fn none() -> Option<ServerClients> {
        Some(ServerClients::default())
    }

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
        assert_eq!(b.decide(p(1), all, none()), Decision::Reserved);
        b.confirm(p(1));
        assert_eq!(b.decide(p(1), all, none()), Decision::Known, "its second channel");
        assert_eq!(b.decide(p(2), all, none()), Decision::Reserved);
        assert_eq!(
            b.decide(p(3), all, none()),
            Decision::OverBudget {
                limit: 2,
                live: vec![1, 2],
                lingering: false,
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
        assert_eq!(b.decide(p(1), all, none()), Decision::Reserved);
        assert_eq!(b.decide(p(1), all, none()), Decision::Known);
        b.release(p(1));
        assert!(
            matches!(b.decide(p(2), all, none()), Decision::OverBudget { .. }),
            "request b is in flight"
        );
        b.confirm(p(1));
        assert!(matches!(b.decide(p(2), all, none()), Decision::OverBudget { .. }));
        assert_eq!(b.admitted(all), vec![1]);
        // Released entirely, then admitted: confirm puts it back.
        let mut b = ProcessBudget::new(1);
        assert_eq!(b.decide(p(3), all, none()), Decision::Reserved);
        b.release(p(3));
        b.confirm(p(3));
        assert!(matches!(b.decide(p(4), all, none()), Decision::OverBudget { .. }));
    }

    #[test]
    fn requests_in_flight_count_against_the_channel_cap() {
        let mut b = ProcessBudget::new(1);
        let all = |_: &ProcessIdentity| true;
        assert_eq!(b.decide(p(1), all, none()), Decision::Reserved);
        for _ in 1..MAX_CHANNELS_PER_PROCESS {
            assert_eq!(b.decide(p(1), all, none()), Decision::Known);
        }
        assert!(matches!(
            b.decide(p(1), all, none()),
            Decision::TooManyChannels { .. }
        ));
    }

    #[test]
    fn a_process_gets_a_bounded_number_of_channels() {
        let mut b = ProcessBudget::new(1);
        let all = |_: &ProcessIdentity| true;
        assert_eq!(b.decide(p(1), all, none()), Decision::Reserved);
        b.confirm(p(1));
        for _ in 1..MAX_CHANNELS_PER_PROCESS {
            assert_eq!(b.decide(p(1), all, none()), Decision::Known);
            b.confirm(p(1));
        }
        assert_eq!(
            b.decide(p(1), all, none()),
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
        assert!(matches!(b.decide(p(2), all, none()), Decision::OverBudget { .. }));
        assert_eq!(b.decide(p(1), all, none()), Decision::Known);
        assert_eq!(b.admitted(all), vec![1]);
    }

    #[test]
    fn a_process_that_exited_frees_its_place() {
        let mut b = ProcessBudget::new(1);
        let dead = RefCell::new(HashSet::new());
        let alive = |x: &ProcessIdentity| !dead.borrow().contains(&x.pid);
        assert_eq!(b.decide(p(1), alive, none()), Decision::Reserved);
        b.confirm(p(1));
        assert!(matches!(
            b.decide(p(2), alive, none()),
            Decision::OverBudget { .. }
        ));
        dead.borrow_mut().insert(1);
        assert_eq!(b.decide(p(2), alive, none()), Decision::Reserved);
    }

    #[test]
    fn a_recycled_pid_is_another_process() {
        let mut b = ProcessBudget::new(1);
        let all = |_: &ProcessIdentity| true;
        assert_eq!(b.decide(p(1), all, none()), Decision::Reserved);
        b.confirm(p(1));
        let recycled = ProcessIdentity {
            pid: 1,
            start_ticks: 5,
        };
        assert!(matches!(
            b.decide(recycled, all, none()),
            Decision::OverBudget { .. }
        ));
    }

    #[test]
    fn a_released_reservation_frees_its_place_but_a_confirmed_one_stays() {
        let mut b = ProcessBudget::new(1);
        let all = |_: &ProcessIdentity| true;
        assert_eq!(b.decide(p(1), all, none()), Decision::Reserved);
        b.release(p(1));
        assert_eq!(b.decide(p(2), all, none()), Decision::Reserved);
        b.confirm(p(2));
        b.release(p(2));
        assert_eq!(b.decide(p(2), all, none()), Decision::Known);
        assert_eq!(ProcessBudget::new(0).limit(), 1);
    }

    #[test]
    fn a_relayed_channel_counts_while_the_server_lists_it_after_its_connector_exited() {
        // The broker (1) got the channel, passed it on and exited; MPS lists it as the client
        // while the process it passed the channel to holds it.
        let mut b = ProcessBudget::new(1);
        let dead = RefCell::new(HashSet::new());
        let alive = |x: &ProcessIdentity| !dead.borrow().contains(&x.pid);
        assert_eq!(b.decide(p(1), alive, none()), Decision::Reserved);
        b.confirm(p(1));
        dead.borrow_mut().insert(1);
        let listing = |pids: &[u32]| ServerClients {
            listed: pids.to_vec(),
            in_container: Vec::new(),
        };
        assert_eq!(
            b.decide(p(2), alive, Some(listing(&[1]))),
            Decision::OverBudget {
                limit: 1,
                live: vec![1],
                lingering: true
            }
        );
        assert_eq!(b.admitted(alive), vec![1], "the view keeps it too");
        // The holder closed its channel: the server lets the client go, its place is free.
        assert_eq!(b.decide(p(2), alive, Some(listing(&[]))), Decision::Reserved);
    }

    #[test]
    fn the_servers_clients_in_the_container_take_places_whoever_connected() {
        // Process 7 reached the server through a channel another process got: nobody here
        // counted it, the server lists it in the container's cgroup.
        let mut b = ProcessBudget::new(2);
        let all = |_: &ProcessIdentity| true;
        let server = ServerClients {
            listed: vec![7, 8, 9],
            in_container: vec![7],
        };
        assert_eq!(b.decide(p(1), all, Some(server.clone())), Decision::Reserved);
        b.confirm(p(1));
        assert_eq!(
            b.decide(p(2), all, Some(server.clone())),
            Decision::OverBudget {
                limit: 2,
                live: vec![1, 7],
                lingering: false
            }
        );
        assert_eq!(b.admitted(all), vec![1, 7]);
        assert_eq!(
            b.decide(p(1), all, None),
            Decision::Known,
            "a counted process still gets its second channel"
        );
        // 7 is counted once even when it connected here itself.
        let mut b = ProcessBudget::new(2);
        let server = ServerClients {
            listed: vec![7],
            in_container: vec![7],
        };
        assert_eq!(b.decide(p(7), all, Some(server.clone())), Decision::Reserved);
        b.confirm(p(7));
        assert_eq!(b.decide(p(8), all, Some(server)), Decision::Reserved);
    }

    #[test]
    fn a_process_that_exited_and_is_no_longer_listed_frees_its_place_at_once() {
        let mut b = ProcessBudget::new(1);
        let dead = RefCell::new(HashSet::new());
        let alive = |x: &ProcessIdentity| !dead.borrow().contains(&x.pid);
        assert_eq!(b.decide(p(1), alive, none()), Decision::Reserved);
        b.confirm(p(1));
        assert!(b.knows(p(1)));
        dead.borrow_mut().insert(1);
        assert_eq!(
            b.decide(
                p(2),
                alive,
                Some(ServerClients {
                    listed: vec![5],
                    in_container: vec![]
                })
            ),
            Decision::Reserved
        );
        assert!(!b.knows(p(1)));
    }

    #[test]
    fn a_counted_process_asking_again_keeps_what_the_server_listed_last() {
        let mut b = ProcessBudget::new(2);
        let dead = RefCell::new(HashSet::new());
        let alive = |x: &ProcessIdentity| !dead.borrow().contains(&x.pid);
        assert_eq!(b.decide(p(1), alive, none()), Decision::Reserved);
        b.confirm(p(1));
        assert_eq!(b.decide(p(2), alive, none()), Decision::Reserved);
        b.confirm(p(2));
        dead.borrow_mut().insert(1);
        let listed = ServerClients {
            listed: vec![1, 2],
            in_container: vec![],
        };
        assert!(matches!(
            b.decide(p(3), alive, Some(listed)),
            Decision::OverBudget { .. }
        ));
        // Process 2's second channel: no new look at the server, and 1 still holds its place.
        assert_eq!(b.decide(p(2), alive, None), Decision::Known);
        assert!(matches!(b.decide(p(3), alive, None), Decision::OverBudget { .. }));
    }

    #[test]
    fn only_a_gate_that_issued_a_channel_needs_the_server_view() {
        let mut b = ProcessBudget::new(1);
        let all = |_: &ProcessIdentity| true;
        assert!(
            !b.needs_server_view(),
            "nothing issued: the server holds none of ours"
        );
        assert_eq!(b.decide(p(1), all, none()), Decision::Reserved);
        assert!(!b.needs_server_view(), "reserved is not issued");
        b.confirm(p(1));
        assert!(b.needs_server_view());
        let mut b = ProcessBudget::new(1);
        b.seed(p(2));
        assert!(b.needs_server_view(), "found on the server after a restart");
    }
}
