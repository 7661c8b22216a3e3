//! One owner per MPS daemon for everything sent to its servers: a task that takes the CUDA
//! clients the gates let through, one at a time and in turn across containers, sets the
//! server's limits to the client's when they differ (policy `exact`), and relays the client's
//! request and the daemon's answer. It is also the only writer of the server's limits under
//! the other policies (the manager sends it [`DaemonAdmission::set_limits`]), so the limits a
//! server holds are known in one place whatever the policy was when they were set: a second
//! cache elsewhere would trust itself after a policy switch and skip a setting that is needed.
//!
//! Why one at a time: the control daemon serves one connection at a time (measured), and an
//! MPS server holds one set of limits, which a client takes when it gets its channel
//! (measured: limits changed after the connection that passed the channel closed did not reach
//! it). So the limits of a client must stay in place from the moment they are set until its
//! connection closed, and nothing else may change them meanwhile: one owner does both.
//!
//! Why in turn across containers: the gate answers the hello itself and only a complete
//! request reaches this queue, so a connection that stalls before its request costs nobody
//! anything; here a container gets one handshake, then the next container does. The daemon is
//! held per client for its answer (0.2-0.4 ms measured, 150-250 ms when it starts the server)
//! and the client's acknowledgement (0.2-2 ms measured, cut after [`ACK_TIMEOUT`]: the client
//! already has its channel, measured to work without it). So another pod waits at most one
//! handshake per container ahead of it.

use std::collections::{HashMap, VecDeque};
use std::os::unix::net::UnixStream;
use std::path::PathBuf;
use std::sync::{Arc, Mutex as StdMutex};
use std::time::{Duration, Instant};

use gpu_mps_api::{ContainerId, DaemonKey, Limits};
use nix::sys::socket::UnixCredentials;
use tokio::io::unix::AsyncFd;
use tokio::sync::{mpsc, oneshot};
use tracing::{info, warn};

use super::seqpacket;
use super::wire;
use crate::mps_control::{self, ControlError, MpsControl};

/// How long the daemon's end stays open for the client's acknowledgement of its channel
/// (measured 0.2 to 2 ms). Past it the daemon's end is closed: the client has its channel
/// already (measured on the H200: a client whose daemon end was closed right after the
/// channel was passed ran with its limits).
pub const ACK_TIMEOUT: Duration = Duration::from_millis(500);

#[derive(Debug, Clone, Copy)]
pub struct RelayTimings {
    /// Longest wait for the daemon: its hello, then its answer to a request.
    pub answer_timeout: Duration,
    pub ack_timeout: Duration,
}

/// A client the gate let through, with the limits its server must hold for it.
pub struct Job {
    pub container: ContainerId,
    /// Policy `exact`: the limits of each of the container's processes; `None`: the server's
    /// limits are the manager's business elsewhere (uniform, ceiling).
    pub class: Option<Limits>,
    pub client: AsyncFd<UnixStream>,
    /// The client's, as the kernel recorded them when it connected: sent with its request,
    /// so the daemon sees the client's pid and uid (never the manager's).
    pub credentials: UnixCredentials,
    /// The container's block (set when one of its processes left the server stuck): checked
    /// right before the job is served, since it may have been queued before the block.
    pub blocked: Arc<StdMutex<Option<String>>>,
    pub done: oneshot::Sender<JobDone>,
}

/// What became of a job; the client's connection comes back with it.
pub struct JobDone {
    pub client: AsyncFd<UnixStream>,
    pub outcome: Outcome,
    /// Time in the queue before it was served.
    pub waited: Duration,
    pub limits_set: bool,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Outcome {
    /// The daemon passed the client its channel.
    Admitted { answer_ms: u64, acked: bool },
    /// The daemon answered something else, or closed without answering; passed on as it was.
    Answered(String),
    /// The client closed before it was served.
    ClientGone,
    /// The container was blocked while the job waited; nothing was sent to the daemon.
    Blocked(String),
    /// The daemon could not be reached, or its limits not set: try again later. `unanswered`:
    /// it did not answer in time (what a stuck server looks like, docs/gpu-results.md section 7).
    Failed { why: String, unanswered: bool },
}

/// A daemon whose server stopped taking clients: it did not answer [`WEDGED_AFTER`] requests
/// in a row. Measured: a process that takes its channel and does not act as a CUDA client
/// leaves the server stuck for every new client until it is killed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct WedgeReport {
    pub daemon: DaemonKey,
    /// The last process that got a channel before the daemon stopped answering, and its
    /// container: the one that left the server stuck, unless the server broke on its own.
    pub suspect: Option<(ContainerId, i32)>,
    pub detail: String,
}

/// Requests in a row the daemon did not answer (each after the handshake timeout, or a CLI
/// command after its timeout) before the server is taken as stuck.
pub const WEDGED_AFTER: u32 = 2;

/// What `gpu-mps status` shows of a daemon's queue.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct QueueView {
    /// The limits the server holds now, as this owner set them (policy `exact`).
    pub class: Option<Limits>,
    pub queued: usize,
    pub served: u64,
    pub limit_changes: u64,
}

/// The handle of a daemon's owner task; cloning shares the task. The task ends when every
/// handle is gone.
#[derive(Clone)]
pub struct DaemonAdmission {
    tx: mpsc::UnboundedSender<Message>,
    view: Arc<StdMutex<QueueView>>,
    name: String,
}

/// What the owner task takes.
enum Message {
    /// A client to relay, and when it was queued.
    Relay(Job, Instant),
    /// Make the servers hold `limits` (policies `uniform` and `ceiling`); the answer is the
    /// servers set, or `None` when they held them already.
    SetLimits {
        limits: Limits,
        reply: oneshot::Sender<Result<Option<Vec<u32>>, ControlError>>,
    },
}

/// Why [`DaemonAdmission::set_limits`] did not set them.
#[derive(Debug, thiserror::Error)]
pub enum SetLimitsError {
    #[error("{0}")]
    Control(#[from] ControlError),
    #[error("the owner of MPS daemon {daemon} has stopped; its limits cannot be set")]
    OwnerGone { daemon: String },
}

/// Where daemon owners report stuck servers; the manager takes the reports on its tick.
pub type WedgeReports = Arc<StdMutex<Vec<WedgeReport>>>;

/// What the server was last given, and by which daemon process: a restarted daemon starts from
/// its defaults, so its limits are set again.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Applied {
    daemon_pid: u32,
    limits: Limits,
}

struct Owner {
    key: DaemonKey,
    pipe_dir: PathBuf,
    gpu_count: usize,
    control: Arc<dyn MpsControl>,
    timings: RelayTimings,
    applied: Option<Applied>,
    view: Arc<StdMutex<QueueView>>,
    /// Requests in a row the daemon did not answer.
    unanswered: u32,
    /// The last process that got a channel.
    last_channel: Option<(ContainerId, i32)>,
    /// The daemon process last reported stuck: it is not reported again (the manager replaces
    /// it on its next tick; requests that time out meanwhile must not get its successor
    /// killed too).
    reported_daemon: Option<u32>,
    reports: WedgeReports,
}

impl DaemonAdmission {
    /// Starts the owner task of the daemon serving `pipe_dir`. Must run in a tokio runtime.
    pub fn spawn(
        key: DaemonKey,
        pipe_dir: PathBuf,
        gpu_count: usize,
        control: Arc<dyn MpsControl>,
        timings: RelayTimings,
        reports: WedgeReports,
    ) -> Self {
        let name_for_errors = key.to_string();
        let (tx, rx) = mpsc::unbounded_channel();
        let view = Arc::new(StdMutex::new(QueueView::default()));
        let owner = Owner {
            key,
            pipe_dir,
            gpu_count,
            control,
            timings,
            applied: None,
            view: view.clone(),
            unanswered: 0,
            last_channel: None,
            reported_daemon: None,
            reports,
        };
        tokio::spawn(owner.run(rx));
        DaemonAdmission {
            tx,
            view,
            name: name_for_errors,
        }
    }

    /// Queues a job; gives it back if the owner task is gone.
    pub fn submit(&self, job: Job) -> Result<(), Job> {
        // Counted before it is sent, so that the owner's decrement never comes first.
        lock(&self.view).queued += 1;
        self.tx.send(Message::Relay(job, Instant::now())).map_err(|e| {
            let mut view = lock(&self.view);
            view.queued = view.queued.saturating_sub(1);
            match e.0 {
                Message::Relay(job, _) => job,
                Message::SetLimits { .. } => unreachable!("a relay was sent"),
            }
        })?;
        Ok(())
    }

    /// Makes the daemon's servers (and its defaults, for servers it starts later) hold
    /// `limits`, in turn with the clients being relayed: never while a client takes its
    /// channel. `None` when they held them already (set by this owner for this daemon process).
    pub async fn set_limits(&self, limits: Limits) -> Result<Option<Vec<u32>>, SetLimitsError> {
        let gone = || SetLimitsError::OwnerGone {
            daemon: self.name.clone(),
        };
        let (reply, answer) = oneshot::channel();
        self.tx
            .send(Message::SetLimits { limits, reply })
            .map_err(|_| gone())?;
        Ok(answer.await.map_err(|_| gone())??)
    }

    pub fn view(&self) -> QueueView {
        lock(&self.view).clone()
    }
}

/// Jobs waiting, per container, and the order in which containers take turns.
#[derive(Default)]
struct RoundRobin {
    queues: HashMap<ContainerId, VecDeque<(Job, Instant)>>,
    turn: VecDeque<ContainerId>,
}

impl RoundRobin {
    fn push(&mut self, job: Job, at: Instant) {
        let queue = self.queues.entry(job.container.clone()).or_default();
        if queue.is_empty() {
            self.turn.push_back(job.container.clone());
        }
        queue.push_back((job, at));
    }

    /// The next container's oldest job; the container goes to the back of the line.
    fn pop(&mut self) -> Option<(Job, Instant)> {
        let container = self.turn.pop_front()?;
        let queue = self.queues.get_mut(&container)?;
        let next = queue.pop_front();
        if queue.is_empty() {
            self.queues.remove(&container);
        } else {
            self.turn.push_back(container);
        }
        next
    }

    fn is_empty(&self) -> bool {
        self.turn.is_empty()
    }
}

/// What serving one job came to.
struct Served {
    outcome: Outcome,
    limits_set: bool,
    /// The daemon handed out a channel for this client (passed on or not).
    channel_issued: bool,
}

impl Served {
    fn nothing(outcome: Outcome) -> Self {
        Served {
            outcome,
            limits_set: false,
            channel_issued: false,
        }
    }
}

impl Owner {
    async fn run(mut self, mut rx: mpsc::UnboundedReceiver<Message>) {
        let mut waiting = RoundRobin::default();
        loop {
            if waiting.is_empty() {
                match rx.recv().await {
                    Some(message) => self.take(message, &mut waiting).await,
                    None => return,
                }
            }
            while let Ok(message) = rx.try_recv() {
                self.take(message, &mut waiting).await;
            }
            let Some((job, at)) = waiting.pop() else {
                continue;
            };
            let waited = at.elapsed();
            let Job {
                container,
                class,
                client,
                credentials,
                blocked,
                done,
            } = job;
            let blocked = lock(&blocked).clone();
            let served = match blocked {
                Some(reason) => Served::nothing(Outcome::Blocked(reason)),
                None => self.serve(&container, class, &client, &credentials).await,
            };
            let Served {
                outcome,
                limits_set,
                channel_issued,
            } = served;
            self.note(&container, credentials.pid(), &outcome, channel_issued);
            {
                let mut view = lock(&self.view);
                view.queued = view.queued.saturating_sub(1);
                view.served += 1;
                if limits_set {
                    view.limit_changes += 1;
                }
                view.class = self.applied.map(|a| a.limits);
            }
            // A gate that stopped waiting (its task was aborted) drops the client with it.
            let _ = done.send(JobDone {
                client,
                outcome,
                waited,
                limits_set,
            });
        }
    }

    /// Queues a client, or sets limits right away: between two clients, never during one.
    async fn take(&mut self, message: Message, waiting: &mut RoundRobin) {
        match message {
            Message::Relay(job, at) => waiting.push(job, at),
            Message::SetLimits { limits, reply } => {
                let result = self.hold_limits(limits, "the manager").await;
                if matches!(result, Ok(Some(_))) {
                    let mut view = lock(&self.view);
                    view.limit_changes += 1;
                    view.class = self.applied.map(|a| a.limits);
                }
                let _ = reply.send(result);
            }
        }
    }

    /// Sets `limits` on the daemon's defaults and servers unless this owner set them on this
    /// daemon process already. The one limit cache of the daemon: keyed by the daemon's pid, so
    /// that a restarted daemon (which starts from its own defaults) gets them again.
    async fn hold_limits(
        &mut self,
        limits: Limits,
        for_whom: &str,
    ) -> Result<Option<Vec<u32>>, ControlError> {
        // Without the daemon's pid there is no telling whether the server is the one the
        // limits were set on: set them again.
        let wanted =
            mps_control::read_pid_file(&self.pipe_dir).map(|daemon_pid| Applied { daemon_pid, limits });
        if wanted.is_some() && self.applied == wanted {
            return Ok(None);
        }
        let before = self.applied.take();
        let started = Instant::now();
        // Unknown until it succeeds: a half-applied change is redone next time.
        let servers = mps_control::apply_limits_everywhere(
            self.control.as_ref(),
            &self.pipe_dir,
            limits,
            self.gpu_count,
        )
        .await?;
        info!(daemon = %self.key, limits = %limits, before = ?before.map(|a| a.limits), servers = ?servers, for_whom, elapsed_ms = started.elapsed().as_millis() as u64, "server limits set and read back");
        self.applied = wanted;
        Ok(Some(servers))
    }

    /// Follows whether the daemon answers, and reports it once when it stops.
    fn note(&mut self, container: &ContainerId, pid: i32, outcome: &Outcome, channel_issued: bool) {
        // The suspect of a stall is the process whose channel was the last thing the daemon
        // did before it stopped answering. A channel the daemon issued counts even when passing
        // it on failed (the process that asked for it may still leave the server stuck); a
        // request served since without a channel clears it: a stall that begins after it
        // began with no channel issued, and blames nobody (a silent connection from elsewhere
        // holds a daemon the same way).
        let unanswered = matches!(outcome, Outcome::Failed { unanswered: true, .. });
        if channel_issued {
            self.last_channel = Some((container.clone(), pid));
        } else if !unanswered && !matches!(outcome, Outcome::ClientGone | Outcome::Blocked(_)) {
            self.last_channel = None;
        }
        match outcome {
            Outcome::Admitted { .. } | Outcome::Answered(_) => {
                self.unanswered = 0;
            }
            Outcome::Failed {
                why,
                unanswered: true,
            } => {
                let daemon = mps_control::read_pid_file(&self.pipe_dir);
                if daemon.is_some() && daemon == self.reported_daemon {
                    return;
                }
                self.unanswered += 1;
                if self.unanswered == WEDGED_AFTER {
                    warn!(daemon = %self.key, suspect = ?self.last_channel, "gate: the MPS server took no client for {WEDGED_AFTER} requests in a row: {why}");
                    lock(&self.reports).push(WedgeReport {
                        daemon: self.key.clone(),
                        suspect: self.last_channel.take(),
                        detail: why.clone(),
                    });
                    // Counting starts again for the server that replaces this one.
                    self.unanswered = 0;
                    self.reported_daemon = daemon;
                }
            }
            Outcome::Failed { .. } | Outcome::ClientGone | Outcome::Blocked(_) => {}
        }
    }

    async fn serve(
        &mut self,
        container: &ContainerId,
        class: Option<Limits>,
        client: &AsyncFd<UnixStream>,
        credentials: &UnixCredentials,
    ) -> Served {
        if closed(client) {
            return Served::nothing(Outcome::ClientGone);
        }
        let mut limits_set = false;
        if let Some(limits) = class {
            let for_whom = format!("container {container}, client pid {}", credentials.pid());
            match self.hold_limits(limits, &for_whom).await {
                Ok(set) => limits_set = set.is_some(),
                Err(e) => {
                    let unanswered = matches!(e, ControlError::Timeout { .. });
                    return Served::nothing(Outcome::Failed {
                        why: format!("setting the server's limits to {limits} failed: {e}"),
                        unanswered,
                    });
                }
            }
        }
        let (outcome, channel_issued) = self.relay(client, credentials).await;
        Served {
            outcome,
            limits_set,
            channel_issued,
        }
    }

    /// Connects to the daemon, sends the client's request with its credentials, passes the
    /// answer on, and the client's acknowledgement back. True with the outcome when the daemon
    /// issued a channel.
    async fn relay(&self, client: &AsyncFd<UnixStream>, credentials: &UnixCredentials) -> (Outcome, bool) {
        let path = self.pipe_dir.join(mps_control::CONTROL_SOCKET);
        let timeout = self.timings.answer_timeout;
        let failed = |what: String, unanswered: bool| Outcome::Failed {
            why: format!("the MPS control daemon at {}: {what}", path.display()),
            unanswered,
        };
        let unanswered = |what: String| failed(what, true);
        let broken = |what: String| failed(what, false);
        // A unix connect blocks while the daemon's backlog is full: not on a runtime thread.
        let connect_path = path.clone();
        let connected = tokio::time::timeout(
            timeout,
            tokio::task::spawn_blocking(move || seqpacket::connect(&connect_path)),
        )
        .await;
        let upstream = match connected {
            Ok(Ok(Ok(stream))) => match seqpacket::watch(stream) {
                Ok(s) => s,
                Err(e) => return (broken(format!("cannot watch the connection: {e}")), false),
            },
            Ok(Ok(Err(e))) => return (broken(format!("cannot connect: {e}")), false),
            Ok(Err(e)) => return (broken(format!("cannot connect: {e}")), false),
            Err(_) => {
                return (
                    unanswered(format!("no connection within {} ms", timeout.as_millis())),
                    false,
                );
            }
        };
        match tokio::time::timeout(timeout, seqpacket::recv_message(&upstream)).await {
            Ok(Ok(Some(hello))) if hello.bytes == wire::HELLO && hello.fd_count() == 0 => {}
            Ok(Ok(Some(other))) => {
                // Fail closed: a daemon that does not speak the measured protocol gets no client.
                warn!(daemon = %self.key, hello = %wire::show(&other.bytes), "gate: the MPS control daemon's hello is not the one measured; nothing is relayed (re-run tests/gpu/shape-probe.sh on this driver)");
                return (
                    broken(format!("unexpected hello {}", wire::show(&other.bytes))),
                    false,
                );
            }
            Ok(Ok(None)) => return (broken("closed before its hello".into()), false),
            Ok(Err(e)) => return (broken(format!("reading its hello: {e}")), false),
            Err(_) => {
                return (
                    unanswered(format!("no hello within {} ms", timeout.as_millis())),
                    false,
                );
            }
        }
        let started = Instant::now();
        for message in [wire::CREDENTIALS, &wire::cuda_client_kind()[..]] {
            if let Err(e) = seqpacket::send_message(&upstream, message, &[], Some(credentials)).await {
                return (broken(format!("sending the request: {e}")), false);
            }
        }
        let answer = match tokio::time::timeout(timeout, seqpacket::recv_message(&upstream)).await {
            Ok(Ok(Some(answer))) => answer,
            // The daemon refused the client (measured: a daemon that is shutting down reads the
            // request and closes). Closing the client too passes that on as it is.
            Ok(Ok(None)) => {
                return (
                    Outcome::Answered("the daemon closed the connection without an answer".into()),
                    false,
                );
            }
            Ok(Err(e)) => return (broken(format!("reading its answer: {e}")), false),
            Err(_) => {
                return (
                    unanswered(format!("no answer within {} ms", timeout.as_millis())),
                    false,
                );
            }
        };
        let answer_ms = started.elapsed().as_millis() as u64;
        let channel = wire::is_channel_answer(&answer.bytes, answer.fd_count());
        if seqpacket::send_message(client, &answer.bytes, &answer.fds(), None)
            .await
            .is_err()
        {
            return (Outcome::ClientGone, channel);
        }
        if !channel {
            return (
                Outcome::Answered(format!(
                    "the daemon answered {} with {} descriptor(s)",
                    wire::show(&answer.bytes),
                    answer.fd_count()
                )),
                false,
            );
        }
        drop(answer);
        let acked = match tokio::time::timeout(self.timings.ack_timeout, seqpacket::recv_message(client))
            .await
        {
            // Only the acknowledgement measured (four zero bytes, no descriptors) is passed
            // on: anything else from the client never reaches the daemon.
            // The acknowledgement must come from the process that connected and asked: a
            // connector that passed its connection on (or exited) before it acknowledged gets
            // its channel refused here; the daemon never hears the acknowledgement.
            Ok(Ok(Some(ack))) if ack.credentials.map(|c| c.pid()) != Some(credentials.pid()) => {
                warn!(daemon = %self.key, client_pid = credentials.pid(), sender = ?ack.credentials.map(|c| c.pid()), "gate: the acknowledgement came from another process than the one that connected (a relayed connection); not passed on");
                false
            }
            Ok(Ok(Some(ack))) if ack.bytes == wire::CLIENT_ACK && ack.fd_count() == 0 => {
                seqpacket::send_message(&upstream, &ack.bytes, &[], Some(credentials))
                    .await
                    .is_ok()
            }
            Ok(Ok(Some(other))) => {
                warn!(daemon = %self.key, client_pid = credentials.pid(), message = %wire::show(&other.bytes), descriptors = other.fd_count(), "gate: the client's acknowledgement is not the one measured; not passed on");
                false
            }
            _ => false,
        };
        (Outcome::Admitted { answer_ms, acked }, true)
    }
}

/// True when the client's end is closed (nothing is taken off the socket).
fn closed(client: &AsyncFd<UnixStream>) -> bool {
    match seqpacket::peek_closed(client.get_ref()) {
        Ok(closed) => closed,
        // Nothing to read: open and waiting, as a client whose request was taken is.
        Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => false,
        Err(_) => true,
    }
}

fn lock<T>(m: &StdMutex<T>) -> std::sync::MutexGuard<'_, T> {
    // Plain data: a panic elsewhere cannot leave it half-written.
    m.lock().unwrap_or_else(|e| e.into_inner())
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    fn job(container: &str, n: u8) -> (Job, oneshot::Receiver<JobDone>) {
        let (a, _b) = std::os::unix::net::UnixStream::pair().unwrap();
        a.set_nonblocking(true).unwrap();
        let (done, rx) = oneshot::channel();
        let job = Job {
            container: ContainerId::parse(container).unwrap(),
            class: Some(Limits {
                memory_bytes: u64::from(n) << 30,
                thread_percentage: n,
            }),
            client: seqpacket::watch(a).unwrap(),
            credentials: UnixCredentials::new(),
            blocked: Arc::default(),
            done,
        };
        (job, rx)
    }

    #[tokio::test]
    async fn containers_take_turns_whatever_one_of_them_queued() {
        let mut rr = RoundRobin::default();
        let now = Instant::now();
        let mut keep = Vec::new();
        // A floods the queue with 64 jobs, then B and C arrive with one each.
        for i in 0..64 {
            let (j, rx) = job("a", (i % 50 + 1) as u8);
            keep.push(rx);
            rr.push(j, now);
        }
        for name in ["b", "c"] {
            let (j, rx) = job(name, 1);
            keep.push(rx);
            rr.push(j, now);
        }
        let order: Vec<String> = std::iter::from_fn(|| rr.pop())
            .take(6)
            .map(|(j, _)| j.container.as_str().to_string())
            .collect();
        assert_eq!(order, ["a", "b", "c", "a", "a", "a"]);
    }

    #[tokio::test]
    async fn a_container_keeps_its_own_order() {
        let mut rr = RoundRobin::default();
        let now = Instant::now();
        let mut keep = Vec::new();
        for n in 1..=3 {
            let (j, rx) = job("a", n);
            keep.push(rx);
            rr.push(j, now);
        }
        let classes: Vec<u8> = std::iter::from_fn(|| rr.pop())
            .map(|(j, _)| j.class.unwrap().thread_percentage)
            .collect();
        assert_eq!(classes, [1, 2, 3]);
        assert!(rr.is_empty());
    }

    fn owner(dir: &std::path::Path, reports: WedgeReports) -> Owner {
        Owner {
            key: DaemonKey::new(["GPU-test"]),
            pipe_dir: dir.to_path_buf(),
            gpu_count: 1,
            control: Arc::new(crate::mps_control::CliControl {
                binary: "/nonexistent/mps-control".into(),
                timeout: Duration::from_secs(1),
            }),
            timings: RelayTimings {
                answer_timeout: Duration::from_millis(10),
                ack_timeout: Duration::from_millis(10),
            },
            applied: None,
            view: Arc::default(),
            unanswered: 0,
            last_channel: None,
            reported_daemon: None,
            reports,
        }
    }

    #[test]
    fn a_stall_that_began_after_a_request_served_without_a_channel_blames_nobody() {
        let dir = tempfile::tempdir().unwrap();
        let stall = || Outcome::Failed {
            why: "no hello within 10 ms".into(),
            unanswered: true,
        };
        let admitted = Outcome::Admitted {
            answer_ms: 1,
            acked: true,
        };
        let innocent = ContainerId::parse("innocent").unwrap();
        let other = ContainerId::parse("other").unwrap();
        // The innocent container got its channel; a later request was answered without one
        // (the daemon worked after that channel); then the daemon stopped answering.
        let reports: WedgeReports = Arc::default();
        let mut o = owner(dir.path(), reports.clone());
        o.note(&innocent, 10, &admitted, true);
        o.note(&other, 11, &Outcome::Answered("closed".into()), false);
        for _ in 0..WEDGED_AFTER {
            o.note(&other, 11, &stall(), false);
        }
        let got = std::mem::take(&mut *lock(&reports));
        assert_eq!(got.len(), 1, "{got:?}");
        assert_eq!(got[0].suspect, None, "nobody is blamed: {got:?}");
        // The channel right before the stall is the suspect.
        let mut o = owner(dir.path(), reports.clone());
        o.note(&other, 11, &Outcome::Answered("closed".into()), false);
        o.note(&innocent, 10, &admitted, true);
        for _ in 0..WEDGED_AFTER {
            o.note(&other, 11, &stall(), false);
        }
        let got = std::mem::take(&mut *lock(&reports));
        assert_eq!(got[0].suspect, Some((innocent, 10)));
    }
}
