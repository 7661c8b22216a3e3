//! One lock per MPS server: the server holds one set of limits at a time and gives it to each
//! client that connects, so the limits of one container must stay in place from its client's
//! first control connection until the client is admitted.
//!
//! Measured on the H200 (docs/gpu-results.md section 5): a CUDA client opens three control
//! connections one after the other: a probe (the daemon's hello, then close), then two in each
//! of which the daemon passes it one descriptor. The server has the client's limits once the
//! first connection that passed a descriptor closed: limits changed between the second and the
//! third connection did not reach the client. So a client is admitted when a connection that
//! passed it a descriptor closed ([`Ticket::mark_admitted`]). Its third connection may run
//! under another class's limits.
//!
//! The lock is held by a limit class, not by a connection: the three control connections of a
//! client, and clients of other containers with the same limits that arrive meanwhile, pass
//! together (a lock per connection deadlocks: a client opens its next connection before the
//! previous one is done). A class admits newcomers only during a join window, so a stream of
//! same-size pods cannot starve a pod of another size queued behind it (tokio's mutex is FIFO).

use std::collections::HashSet;
use std::future::Future;
use std::sync::{Arc, Mutex as StdMutex};
use std::time::Duration;

use gpu_mps_api::Limits;
use tokio::sync::{Mutex, OwnedMutexGuard};
use tokio::time::Instant;

/// What the server was last given, and by which daemon process: a restarted daemon starts
/// from its defaults, so its limits are set again.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Applied {
    pub daemon_pid: u32,
    pub limits: Limits,
}

#[derive(Debug, Clone, Copy)]
pub struct AdmissionTimings {
    /// Longest wait for the lock; then the connection is refused.
    pub queue_timeout: Duration,
    /// How long after a class took the lock others of the same class may still join it.
    pub join_window: Duration,
    /// How long a class's clients that already entered may come back for their next
    /// connection; past it they queue like anyone, so no class can keep the lock.
    pub session_cap: Duration,
    /// How long the lock waits, once no connection is open, for a client that entered but was
    /// not admitted to come back (between a client's connections: 0.2 to 44 ms measured); then
    /// the client is taken as gone (it died, or it only probed).
    pub abandon_grace: Duration,
}

#[derive(Debug, PartialEq, Eq)]
pub enum EnterError<E> {
    /// The lock was not free within the queue timeout.
    QueueTimeout {
        waited: Duration,
        holder: Option<Limits>,
    },
    /// Setting the limits failed; the lock was released.
    Apply(E),
}

struct Session {
    limits: Limits,
    /// The daemon the limits were set on: a restarted one starts from its defaults.
    daemon_pid: u32,
    open: usize,
    /// Connections closed so far: a grace timer only releases if none closed after it started.
    closes: u64,
    /// Client pids that entered and are not admitted yet.
    pending: HashSet<i32>,
    admitted: HashSet<i32>,
    opened_at: Instant,
    generation: u64,
    /// Held, never read: the lock is the class's until the session is dropped.
    _lock: OwnedMutexGuard<Option<Applied>>,
}

#[derive(Default)]
struct SessionSlot {
    session: Option<Session>,
    generation: u64,
}

pub struct ServerAdmission {
    /// The daemon's name, for logs.
    name: String,
    applied: Arc<Mutex<Option<Applied>>>,
    slot: Arc<StdMutex<SessionSlot>>,
    timings: AdmissionTimings,
}

/// One admitted connection. Dropping it leaves the class; the last one out releases the lock
/// after the settle time.
pub struct Ticket {
    name: String,
    slot: Arc<StdMutex<SessionSlot>>,
    generation: u64,
    client_pid: i32,
    admitted: bool,
    abandon_grace: Duration,
    /// How long this connection waited for the lock.
    pub waited: Duration,
    /// Whether this connection's arrival set the server's limits.
    pub applied_limits: bool,
}

impl ServerAdmission {
    pub fn new(name: impl Into<String>, timings: AdmissionTimings) -> Self {
        ServerAdmission {
            name: name.into(),
            applied: Arc::new(Mutex::new(None)),
            slot: Arc::new(StdMutex::new(SessionSlot::default())),
            timings,
        }
    }

    /// The class holding the lock now, if any.
    pub fn holder(&self) -> Option<Limits> {
        lock(&self.slot).session.as_ref().map(|s| s.limits)
    }

    /// Enters class `limits` for a connection of `client_pid`. When the lock changes hands to
    /// this class, `apply` runs under it with what the server was last given, and returns what
    /// it is given now.
    pub async fn enter<E, F, Fut>(
        &self,
        limits: Limits,
        daemon_pid: u32,
        client_pid: i32,
        apply: F,
    ) -> Result<Ticket, EnterError<E>>
    where
        F: FnOnce(Option<Applied>) -> Fut,
        Fut: Future<Output = Result<(), E>>,
    {
        let started = Instant::now();
        if let Some(ticket) = self.join(limits, daemon_pid, client_pid, started) {
            return Ok(ticket);
        }
        let mut guard =
            match tokio::time::timeout(self.timings.queue_timeout, self.applied.clone().lock_owned()).await {
                Ok(guard) => guard,
                Err(_) => {
                    return Err(EnterError::QueueTimeout {
                        waited: started.elapsed(),
                        holder: self.holder(),
                    });
                }
            };
        let wanted = Applied { daemon_pid, limits };
        let mut applied_limits = false;
        if *guard != Some(wanted) {
            let before = *guard;
            // Unknown until it succeeds: a half-applied change must be redone by the next class.
            *guard = None;
            apply(before).await.map_err(EnterError::Apply)?;
            *guard = Some(wanted);
            applied_limits = true;
        }
        let mut slot = lock(&self.slot);
        slot.generation += 1;
        let generation = slot.generation;
        slot.session = Some(Session {
            limits,
            daemon_pid,
            open: 1,
            closes: 0,
            pending: HashSet::from([client_pid]),
            admitted: HashSet::new(),
            opened_at: Instant::now(),
            generation,
            _lock: guard,
        });
        Ok(Ticket {
            name: self.name.clone(),
            slot: self.slot.clone(),
            generation,
            client_pid,
            admitted: false,
            abandon_grace: self.timings.abandon_grace,
            waited: started.elapsed(),
            applied_limits,
        })
    }

    fn join(&self, limits: Limits, daemon_pid: u32, client_pid: i32, started: Instant) -> Option<Ticket> {
        let mut slot = lock(&self.slot);
        let s = slot.session.as_mut()?;
        if s.limits != limits || s.daemon_pid != daemon_pid {
            return None;
        }
        // A client already in this session comes back for its next connection: let it in (its
        // own limits are set) until the session cap. Others only while the join window is open.
        let returning = s.pending.contains(&client_pid) || s.admitted.contains(&client_pid);
        let age = s.opened_at.elapsed();
        let window = if returning {
            self.timings.session_cap
        } else {
            self.timings.join_window
        };
        if age > window {
            return None;
        }
        s.open += 1;
        if !s.admitted.contains(&client_pid) {
            s.pending.insert(client_pid);
        }
        Some(Ticket {
            name: self.name.clone(),
            slot: self.slot.clone(),
            generation: s.generation,
            client_pid,
            admitted: false,
            abandon_grace: self.timings.abandon_grace,
            waited: started.elapsed(),
            applied_limits: false,
        })
    }
}

impl Ticket {
    /// The daemon passed this connection's client a descriptor: once the connection closes,
    /// the server has the client's limits.
    pub fn mark_admitted(&mut self) {
        self.admitted = true;
    }
}

impl Drop for Ticket {
    fn drop(&mut self) {
        let mut slot = lock(&self.slot);
        let Some(s) = slot.session.as_mut().filter(|s| s.generation == self.generation) else {
            return;
        };
        s.open -= 1;
        s.closes += 1;
        if self.admitted {
            s.pending.remove(&self.client_pid);
            s.admitted.insert(self.client_pid);
        }
        if s.open > 0 {
            return;
        }
        if s.pending.is_empty() {
            slot.session = None;
            return;
        }
        let (slot, generation, grace, closes) =
            (self.slot.clone(), self.generation, self.abandon_grace, s.closes);
        let name = self.name.clone();
        // Outside a runtime (a test dropping a ticket) the lock is released at once.
        let Ok(runtime) = tokio::runtime::Handle::try_current() else {
            lock(&slot).session = None;
            return;
        };
        runtime.spawn(async move {
            tokio::time::sleep(grace).await;
            let mut slot = lock(&slot);
            if let Some(s) = slot
                .session
                .as_ref()
                .filter(|s| s.generation == generation && s.open == 0 && s.closes == closes)
            {
                tracing::warn!(daemon = %name, limits = %s.limits, client_pids = ?s.pending, grace_ms = grace.as_millis() as u64, "gate: a client entered but was not admitted and did not come back (it died, or only probed); the server's lock goes to the next class");
                slot.session = None;
            }
        });
    }
}

fn lock(slot: &StdMutex<SessionSlot>) -> std::sync::MutexGuard<'_, SessionSlot> {
    // The slot holds plain data: a panic elsewhere cannot leave it half-written.
    slot.lock().unwrap_or_else(|e| e.into_inner())
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use std::sync::atomic::{AtomicUsize, Ordering};

    use super::*;

    const A: Limits = Limits {
        memory_bytes: 4 << 30,
        thread_percentage: 25,
    };
    const B: Limits = Limits {
        memory_bytes: 8 << 30,
        thread_percentage: 50,
    };
    const GRACE: Duration = Duration::from_millis(500);

    fn admission() -> Arc<ServerAdmission> {
        Arc::new(ServerAdmission::new(
            "GPU-test",
            AdmissionTimings {
                queue_timeout: Duration::from_secs(5),
                join_window: Duration::from_secs(1),
                session_cap: Duration::from_secs(3),
                abandon_grace: GRACE,
            },
        ))
    }

    async fn ok(_: Option<Applied>) -> Result<(), String> {
        Ok(())
    }

    /// One connection of `pid` that got a descriptor (or not), closed.
    fn done(mut t: Ticket, admitted: bool) {
        if admitted {
            t.mark_admitted();
        }
        drop(t);
    }

    fn wait_for_b(a: &Arc<ServerAdmission>) -> tokio::task::JoinHandle<(bool, Instant)> {
        let a = a.clone();
        tokio::spawn(async move {
            let t = a.enter(B, 1, 200, ok).await.unwrap();
            (t.applied_limits, Instant::now())
        })
    }

    #[tokio::test(start_paused = true)]
    async fn the_lock_stays_with_a_class_until_its_client_got_a_descriptor() {
        let a = admission();
        // The measured shape: probe connection, then one that passes a descriptor.
        let probe = a.enter(A, 1, 100, ok).await.unwrap();
        assert!(probe.applied_limits);
        let b = wait_for_b(&a);
        done(probe, false);
        tokio::time::sleep(Duration::from_millis(100)).await;
        assert!(
            !b.is_finished(),
            "released between the probe and the next connection"
        );
        let second = a.enter(A, 1, 100, ok).await.unwrap();
        assert!(!second.applied_limits, "same class: nothing to set");
        let admitted_at = Instant::now();
        done(second, true);
        let (applied, at) = b.await.unwrap();
        assert!(applied);
        assert_eq!(at, admitted_at, "released as soon as the client was admitted");
        assert_eq!(a.holder(), Some(B));
    }

    #[tokio::test(start_paused = true)]
    async fn a_client_that_never_comes_back_frees_the_lock_after_the_grace() {
        let a = admission();
        let probe = a.enter(A, 1, 100, ok).await.unwrap();
        let b = wait_for_b(&a);
        let closed = Instant::now();
        done(probe, false);
        let (_, at) = b.await.unwrap();
        assert!(at - closed >= GRACE, "released {:?} after the close", at - closed);
    }

    #[tokio::test(start_paused = true)]
    async fn every_client_of_a_class_must_be_admitted() {
        let a = admission();
        let c1 = a.enter(A, 1, 100, ok).await.unwrap();
        let c2 = a.enter(A, 1, 101, ok).await.unwrap();
        assert!(!c2.applied_limits, "same class joins");
        let b = wait_for_b(&a);
        done(c1, true);
        tokio::time::sleep(Duration::from_millis(100)).await;
        assert!(!b.is_finished(), "client 101 is still connected");
        done(c2, false);
        tokio::time::sleep(Duration::from_millis(100)).await;
        assert!(!b.is_finished(), "client 101 is not admitted yet");
        let c2 = a.enter(A, 1, 101, ok).await.unwrap();
        done(c2, true);
        b.await.unwrap();
    }

    #[tokio::test(start_paused = true)]
    async fn limits_are_set_only_when_they_change_or_the_daemon_did() {
        let a = admission();
        let calls = Arc::new(AtomicUsize::new(0));
        let counting = |c: Arc<AtomicUsize>| {
            move |_: Option<Applied>| {
                c.fetch_add(1, Ordering::SeqCst);
                async { Ok::<(), String>(()) }
            }
        };
        done(a.enter(A, 1, 100, counting(calls.clone())).await.unwrap(), true);
        done(a.enter(A, 1, 101, counting(calls.clone())).await.unwrap(), true);
        assert_eq!(
            calls.load(Ordering::SeqCst),
            1,
            "same limits, same daemon: nothing to set"
        );
        done(a.enter(A, 2, 102, counting(calls.clone())).await.unwrap(), true);
        assert_eq!(
            calls.load(Ordering::SeqCst),
            2,
            "a new daemon starts from its defaults"
        );
    }

    #[tokio::test(start_paused = true)]
    async fn a_failed_apply_releases_the_lock_and_is_redone_next_time() {
        let a = admission();
        let e = a
            .enter(A, 1, 100, |_| async { Err::<(), _>("rejected".to_string()) })
            .await
            .err()
            .unwrap();
        assert_eq!(e, EnterError::Apply("rejected".to_string()));
        assert_eq!(a.holder(), None);
        let t = a.enter(A, 1, 100, ok).await.unwrap();
        assert!(t.applied_limits, "nothing is known to be set after a failure");
    }

    #[tokio::test(start_paused = true)]
    async fn a_holder_that_never_leaves_times_out_the_queue() {
        let a = admission();
        let _stuck = a.enter(A, 1, 100, ok).await.unwrap();
        let e = a.enter(B, 1, 200, ok).await.err().unwrap();
        assert!(
            matches!(e, EnterError::QueueTimeout { holder: Some(h), waited } if h == A && waited >= Duration::from_secs(5)),
            "{e:?}"
        );
    }

    #[tokio::test(start_paused = true)]
    async fn the_join_window_keeps_a_same_class_stream_from_starving_others() {
        let a = admission();
        let mut held = vec![a.enter(A, 1, 1, ok).await.unwrap()];
        let b = wait_for_b(&a);
        // New same-class clients keep overlapping, past the join window.
        for pid in 2..32 {
            tokio::time::sleep(Duration::from_millis(100)).await;
            let a2 = a.clone();
            let next =
                tokio::time::timeout(
                    Duration::from_millis(10),
                    async move { a2.enter(A, 1, pid, ok).await },
                )
                .await;
            if let Ok(Ok(t)) = next {
                held.push(t);
            }
            if !held.is_empty() {
                done(held.remove(0), true);
            }
        }
        held.into_iter().for_each(|t| done(t, true));
        b.await.unwrap();
    }

    #[tokio::test(start_paused = true)]
    async fn a_restarted_daemon_is_never_joined_without_setting_its_limits() {
        let a = admission();
        let first = a.enter(A, 1, 100, ok).await.unwrap();
        // Same class, but the daemon is a new process: wait for the lock, set the limits again.
        let a2 = a.clone();
        let second = tokio::spawn(async move { a2.enter(A, 2, 101, ok).await.map(|t| t.applied_limits) });
        tokio::time::sleep(Duration::from_millis(50)).await;
        assert!(!second.is_finished(), "joined a session of another daemon");
        done(first, true);
        assert!(second.await.unwrap().unwrap());
    }

    #[tokio::test(start_paused = true)]
    async fn a_client_that_keeps_coming_back_cannot_keep_the_lock() {
        let a = admission();
        let b = wait_for_b(&a);
        // Pid 100 reconnects every 100 ms without ever being admitted.
        let started = Instant::now();
        let mut held = a.enter(A, 1, 100, ok).await.unwrap();
        while !b.is_finished() && started.elapsed() < Duration::from_secs(20) {
            tokio::time::sleep(Duration::from_millis(100)).await;
            let a2 = a.clone();
            let next =
                tokio::time::timeout(
                    Duration::from_millis(5),
                    async move { a2.enter(A, 1, 100, ok).await },
                )
                .await;
            drop(std::mem::replace(
                &mut held,
                match next {
                    Ok(Ok(t)) => t,
                    _ => break,
                },
            ));
        }
        drop(held);
        let (_, at) = b.await.unwrap();
        assert!(
            at - started <= Duration::from_secs(4),
            "class B waited {:?}",
            at - started
        );
    }

    #[tokio::test(start_paused = true)]
    async fn the_grace_counts_from_the_last_close() {
        let a = admission();
        let b = wait_for_b(&a);
        done(a.enter(A, 1, 100, ok).await.unwrap(), false);
        tokio::time::sleep(GRACE - Duration::from_millis(100)).await;
        // The client comes back just before the grace ends, and leaves again unadmitted.
        let last_close = {
            let t = a.enter(A, 1, 100, ok).await.unwrap();
            tokio::time::sleep(Duration::from_millis(10)).await;
            done(t, false);
            Instant::now()
        };
        let (_, at) = b.await.unwrap();
        assert!(
            at - last_close >= GRACE,
            "released {:?} after the last close",
            at - last_close
        );
    }
}
