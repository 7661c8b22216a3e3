//! What the fake control daemon remembers: default limits, servers and their clients, and the
//! answer to every command. No I/O: processes and client connections are behind traits, so the
//! rules are unit-tested without spawning anything.

use std::collections::BTreeMap;
use std::sync::Arc;

use crate::command::Command;
use crate::limits::{format_mem_mib, format_mem_mib_as_cli, format_threads, parse_mem_mib, parse_threads};

/// A running fake MPS server process.
pub trait ServerProcess: Send {
    fn pid(&self) -> u32;
    /// True once the process is gone (and reaped).
    fn has_exited(&mut self) -> bool;
    /// Stops the process and reaps it.
    fn stop(&mut self);
}

/// Starts fake MPS server processes.
pub trait ServerLauncher: Send {
    fn launch(&mut self, uid: u32) -> std::io::Result<Box<dyn ServerProcess>>;
}

/// The daemon's end of a CUDA client's channel to its server.
pub trait ClientLink: Send + Sync {
    /// Closes the connection, so the client sees its server go away.
    fn disconnect(&self);
}

pub type ClientId = u64;

/// Clients one server takes: the limit MPS documents for Volta and later, per device. The fake
/// counts it per server.
pub const MAX_CLIENTS_PER_SERVER: usize = 48;

struct Client {
    id: ClientId,
    pid: i32,
    link: Arc<dyn ClientLink>,
}

struct Server {
    process: Box<dyn ServerProcess>,
    pid: u32,
    uid: u32,
    threads: f64,
    /// MiB per device id as given to set_*: ordinals in practice, any text is kept (MPS does not
    /// validate device ids).
    mem: BTreeMap<String, u64>,
    clients: Vec<Client>,
    /// `shutdown_server` without `-f` while clients were connected: stops once they are gone and
    /// takes no new clients.
    stopping: bool,
}

/// What the control CLI prints for one command (complete, with its newlines), and whether
/// the daemon must exit after answering.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Reply {
    pub text: String,
    pub quit: bool,
}

impl Reply {
    fn empty() -> Reply {
        Reply {
            text: String::new(),
            quit: false,
        }
    }

    fn line(text: impl Into<String>) -> Reply {
        let mut text = text.into();
        text.push('\n');
        Reply { text, quit: false }
    }

    fn lines<I: IntoIterator<Item = String>>(lines: I) -> Reply {
        let text = lines.into_iter().map(|l| l + "\n").collect();
        Reply { text, quit: false }
    }

    fn server_not_found(token: &str) -> Reply {
        Reply::line(format!("Server {token} not found"))
    }
}

/// A CUDA client taken by a server.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Admission {
    pub client_id: ClientId,
    pub server_pid: u32,
    pub new_server: bool,
    /// The answer line sent to the client: `SERVER <pid> THREADS <p> MEM <dev>=<v>[,...]`.
    pub line: String,
}

pub struct State {
    multiuser: bool,
    device_count: usize,
    max_clients: usize,
    default_threads: f64,
    default_mem: BTreeMap<String, u64>,
    servers: Vec<Server>,
    launcher: Box<dyn ServerLauncher>,
    next_client: ClientId,
    events: Vec<String>,
    /// Pids of clients whose server died under them: a CUDA client opens a second connection
    /// for another descriptor, which must not make it a new client of the next server.
    lost_clients: std::collections::BTreeSet<i32>,
}

impl State {
    /// `device_count`: how many devices the daemon's CUDA_VISIBLE_DEVICES names; the `MEM` list
    /// a client gets has one entry per ordinal.
    pub fn new(multiuser: bool, device_count: usize, launcher: Box<dyn ServerLauncher>) -> State {
        State {
            multiuser,
            device_count: device_count.max(1),
            max_clients: MAX_CLIENTS_PER_SERVER,
            default_threads: 100.0,
            default_mem: BTreeMap::new(),
            servers: Vec::new(),
            launcher,
            next_client: 1,
            events: Vec::new(),
            lost_clients: std::collections::BTreeSet::new(),
        }
    }

    /// Another cap on the clients of one server (tests reach it without 48 clients).
    pub fn with_max_clients(mut self, max_clients: usize) -> State {
        self.max_clients = max_clients;
        self
    }

    /// Things that happened besides the answers (servers started or stopped), for the log.
    pub fn take_events(&mut self) -> Vec<String> {
        std::mem::take(&mut self.events)
    }

    pub fn execute(&mut self, line: &str) -> Reply {
        self.reap();
        match Command::parse(line) {
            Command::GetServerList => Reply::lines(self.servers.iter().map(|s| s.pid.to_string())),
            Command::GetClientList { server } => match self.find(&server) {
                Some(s) => Reply::lines(s.clients.iter().map(|c| c.pid.to_string())),
                None => Reply::server_not_found(&server),
            },
            Command::GetDefaultActiveThreadPercentage => Reply::line(format_threads(self.default_threads)),
            Command::SetDefaultActiveThreadPercentage { value } => {
                // A refused value echoes the one still in force (measured with 250).
                if let Some(v) = parse_threads(&value) {
                    self.default_threads = v;
                }
                Reply::line(format_threads(self.default_threads))
            }
            Command::GetDefaultDevicePinnedMemLimit { device } => Reply::line(format_mem_mib_as_cli(
                self.default_mem.get(&device).copied().unwrap_or(0),
            )),
            Command::SetDefaultDevicePinnedMemLimit { device, value } => {
                match parse_mem_mib(&value) {
                    Some(mib) => {
                        self.default_mem.insert(device, mib);
                    }
                    // What the real one answers to a malformed value was not measured.
                    None => self
                        .events
                        .push(format!("Ignored malformed memory limit {value:?}")),
                }
                Reply::empty()
            }
            Command::GetActiveThreadPercentage { server } => match self.find(&server) {
                Some(s) => Reply::line(format_threads(s.threads)),
                None => Reply::server_not_found(&server),
            },
            Command::SetActiveThreadPercentage { server, value } => match self.find(&server) {
                Some(s) => {
                    if let Some(v) = parse_threads(&value) {
                        s.threads = v;
                    }
                    Reply::line(format_threads(s.threads))
                }
                None => Reply::server_not_found(&server),
            },
            Command::GetDevicePinnedMemLimit { server, device } => match self.find(&server) {
                Some(s) => Reply::line(format_mem_mib_as_cli(s.mem.get(&device).copied().unwrap_or(0))),
                None => Reply::server_not_found(&server),
            },
            Command::SetDevicePinnedMemLimit {
                server,
                device,
                value,
            } => {
                let Some(s) = self.find(&server) else {
                    return Reply::server_not_found(&server);
                };
                match parse_mem_mib(&value) {
                    Some(mib) => {
                        s.mem.insert(device, mib);
                    }
                    None => self
                        .events
                        .push(format!("Ignored malformed memory limit {value:?}")),
                }
                Reply::empty()
            }
            Command::GetDeviceClientList { server } => self.device_client_list(server.as_deref()),
            Command::StartServer { uid } => {
                // What the real one prints here was not measured; it prints nothing on success
                // for the other set-like commands.
                if let Err(e) = self.ensure_server(uid) {
                    self.events.push(e);
                }
                Reply::empty()
            }
            Command::ShutdownServer { server, force } => {
                let Some(index) = self.index_of(&server) else {
                    return Reply::server_not_found(&server);
                };
                if force || self.servers[index].clients.is_empty() {
                    self.stop_server(index, "shut down");
                } else {
                    self.servers[index].stopping = true;
                    self.events
                        .push(format!("Server {server} stops when its clients are gone"));
                }
                Reply::empty()
            }
            Command::TerminateClient { server, client } => {
                let Some(s) = self.find(&server) else {
                    return Reply::server_not_found(&server);
                };
                let pid: Option<i32> = client.parse().ok();
                let (gone, kept): (Vec<Client>, Vec<Client>) = std::mem::take(&mut s.clients)
                    .into_iter()
                    .partition(|c| Some(c.pid) == pid);
                s.clients = kept;
                for c in &gone {
                    c.link.disconnect();
                }
                self.events
                    .push(format!("Terminated {} client(s) with pid {client}", gone.len()));
                self.stop_if_drained();
                Reply::empty()
            }
            Command::Quit => {
                self.stop_all();
                Reply {
                    text: String::new(),
                    quit: true,
                }
            }
            Command::Unknown(line) => Reply::line(format!("Unknown command \"{line}\"")),
        }
    }

    /// A CUDA client connects: give it the server of its user (any user with `-M`), starting
    /// one with the CURRENT default limits when none runs, as the real daemon does.
    pub fn admit_client(
        &mut self,
        pid: i32,
        uid: u32,
        link: Arc<dyn ClientLink>,
    ) -> Result<Admission, String> {
        self.reap();
        let (index, new_server) = self.ensure_server(uid)?;
        let server = &self.servers[index];
        if server.clients.len() >= self.max_clients {
            return Err(format!(
                "server {} already has {} clients, its limit",
                server.pid,
                server.clients.len()
            ));
        }
        let client_id = self.next_client;
        self.next_client += 1;
        let device_count = self.device_count;
        let server = &mut self.servers[index];
        server.clients.push(Client {
            id: client_id,
            pid,
            link,
        });
        let mem = (0..device_count)
            .map(|d| {
                format!(
                    "{d}={}",
                    format_mem_mib(server.mem.get(&d.to_string()).copied().unwrap_or(0))
                )
            })
            .collect::<Vec<_>>()
            .join(",");
        Ok(Admission {
            client_id,
            server_pid: server.pid,
            new_server,
            line: format!(
                "SERVER {} THREADS {} MEM {mem}",
                server.pid,
                format_threads(server.threads)
            ),
        })
    }

    /// Whether a client of this pid is on a server: a CUDA client's second kind-2 connection
    /// then only gets another descriptor.
    pub fn has_client(&mut self, pid: i32) -> bool {
        self.reap();
        self.servers
            .iter()
            .any(|s| s.clients.iter().any(|c| c.pid == pid))
    }

    /// True once for a pid whose server died under it (then forgotten: a pid is reused).
    pub fn take_lost_client(&mut self, pid: i32) -> bool {
        self.reap();
        self.lost_clients.remove(&pid)
    }

    /// Whether the client is still on a server: a client whose server died was disconnected
    /// by the daemon, not by itself.
    pub fn holds_client(&mut self, id: ClientId) -> bool {
        self.reap();
        self.servers.iter().any(|s| s.clients.iter().any(|c| c.id == id))
    }

    /// The client's channel closed. Returns its pid when it was still listed.
    pub fn remove_client(&mut self, id: ClientId) -> Option<i32> {
        let mut pid = None;
        for server in &mut self.servers {
            if let Some(pos) = server.clients.iter().position(|c| c.id == id) {
                pid = Some(server.clients.remove(pos).pid);
            }
        }
        self.stop_if_drained();
        pid
    }

    /// Stops every server (quit, or the daemon was signalled).
    pub fn stop_all(&mut self) {
        while !self.servers.is_empty() {
            self.stop_server(0, "stopped by quit");
        }
    }

    fn find(&mut self, token: &str) -> Option<&mut Server> {
        let index = self.index_of(token)?;
        Some(&mut self.servers[index])
    }

    fn index_of(&self, token: &str) -> Option<usize> {
        let pid: u32 = token.parse().ok()?;
        self.servers.iter().position(|s| s.pid == pid)
    }

    fn ensure_server(&mut self, uid: u32) -> Result<(usize, bool), String> {
        let multiuser = self.multiuser;
        if let Some(i) = self
            .servers
            .iter()
            .position(|s| !s.stopping && (multiuser || s.uid == uid))
        {
            return Ok((i, false));
        }
        if !multiuser {
            // One server per user: the real daemon stops an idle server of another user (measured)
            // and queues the client while that server is busy. The fake does not queue.
            if let Some(busy) = self.servers.iter().find(|s| !s.stopping && !s.clients.is_empty()) {
                return Err(format!(
                    "server {} of user {} has clients; this fake does not queue clients of user {uid}",
                    busy.pid, busy.uid
                ));
            }
            while let Some(i) = self.servers.iter().position(|s| !s.stopping) {
                self.stop_server(i, &format!("stopped for a client of user {uid}"));
            }
        }
        let process = self
            .launcher
            .launch(uid)
            .map_err(|e| format!("cannot start a fake server: {e}"))?;
        let pid = process.pid();
        self.events.push(format!(
            "Starting new server {pid} for user {uid} (threads {}, memory {:?})",
            format_threads(self.default_threads),
            self.default_mem
        ));
        self.servers.push(Server {
            process,
            pid,
            uid,
            threads: self.default_threads,
            mem: self.default_mem.clone(),
            clients: Vec::new(),
            stopping: false,
        });
        Ok((self.servers.len() - 1, true))
    }

    fn device_client_list(&mut self, server: Option<&str>) -> Reply {
        let pids: Vec<i32> = match server {
            Some(token) => match self.find(token) {
                Some(s) => s.clients.iter().map(|c| c.pid).collect(),
                None => return Reply::server_not_found(token),
            },
            None => self
                .servers
                .iter()
                .flat_map(|s| s.clients.iter().map(|c| c.pid))
                .collect(),
        };
        if pids.is_empty() {
            return Reply::empty();
        }
        // Measured shape: `[0] 00:00.0, NVIDIA H200` then `604.1` per client. What the `.1` means
        // is not known; the fake always prints it.
        let mut lines = Vec::new();
        for d in 0..self.device_count {
            lines.push(format!("[{d}] {d:02x}:00.0, FAKE GPU (gpu-mps test double)"));
            lines.extend(pids.iter().map(|p| format!("{p}.1")));
        }
        Reply::lines(lines)
    }

    fn stop_if_drained(&mut self) {
        while let Some(i) = self
            .servers
            .iter()
            .position(|s| s.stopping && s.clients.is_empty())
        {
            self.stop_server(i, "shut down after its last client");
        }
    }

    fn stop_server(&mut self, index: usize, why: &str) {
        let mut server = self.servers.remove(index);
        for c in &server.clients {
            c.link.disconnect();
        }
        server.process.stop();
        self.events.push(format!("Server {} {why}", server.pid));
    }

    /// Forgets servers whose process died (killed from outside), disconnecting their clients.
    fn reap(&mut self) {
        let mut i = 0;
        while i < self.servers.len() {
            if self.servers[i].process.has_exited() {
                let server = self.servers.remove(i);
                for c in &server.clients {
                    c.link.disconnect();
                    self.lost_clients.insert(c.pid);
                }
                self.events.push(format!("Server {} exited", server.pid));
            } else {
                i += 1;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Mutex;
    use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};

    #[derive(Default)]
    struct Record {
        stopped: Mutex<Vec<u32>>,
        dead: Mutex<Vec<u32>>,
    }

    struct FakeProcess {
        pid: u32,
        record: Arc<Record>,
    }

    impl ServerProcess for FakeProcess {
        fn pid(&self) -> u32 {
            self.pid
        }
        fn has_exited(&mut self) -> bool {
            self.record.dead.lock().expect("lock").contains(&self.pid)
        }
        fn stop(&mut self) {
            self.record.stopped.lock().expect("lock").push(self.pid);
        }
    }

    struct FakeLauncher {
        next: Arc<AtomicU32>,
        record: Arc<Record>,
    }

    impl ServerLauncher for FakeLauncher {
        fn launch(&mut self, _uid: u32) -> std::io::Result<Box<dyn ServerProcess>> {
            let pid = self.next.fetch_add(1, Ordering::SeqCst);
            Ok(Box::new(FakeProcess {
                pid,
                record: self.record.clone(),
            }))
        }
    }

    #[derive(Default)]
    struct FakeLink(AtomicBool);

    impl ClientLink for FakeLink {
        fn disconnect(&self) {
            self.0.store(true, Ordering::SeqCst);
        }
    }

    fn state(multiuser: bool, devices: usize) -> (State, Arc<Record>) {
        let record = Arc::new(Record::default());
        let launcher = FakeLauncher {
            next: Arc::new(AtomicU32::new(607)),
            record: record.clone(),
        };
        (State::new(multiuser, devices, Box::new(launcher)), record)
    }

    fn run(state: &mut State, line: &str) -> String {
        state.execute(line).text
    }

    #[test]
    fn measured_answers_without_servers() {
        let (mut s, _) = state(true, 1);
        let table = [
            ("get_server_list", ""),
            ("get_default_active_thread_percentage", "100.0\n"),
            ("set_default_active_thread_percentage 25", "25.0\n"),
            ("get_default_active_thread_percentage", "25.0\n"),
            ("set_default_device_pinned_mem_limit 0 4096M", ""),
            ("get_default_device_pinned_mem_limit 0", "4G\n"),
            ("set_default_device_pinned_mem_limit 0 4G", ""),
            ("get_default_device_pinned_mem_limit 0", "4G\n"),
            ("set_default_device_pinned_mem_limit 7 4G", ""),
            ("get_default_device_pinned_mem_limit 7", "4G\n"),
            ("set_default_device_pinned_mem_limit 1 3000M", ""),
            // Printed in whole GiB, rounded down (measured on the H200).
            ("get_default_device_pinned_mem_limit 1", "2G\n"),
            ("get_default_device_pinned_mem_limit 2", "0\n"),
            ("set_default_active_thread_percentage 250", "25.0\n"),
            ("get_default_active_thread_percentage", "25.0\n"),
            ("bogus_command", "Unknown command \"bogus_command\"\n"),
            (
                "set_active_thread_percentage 99999 30",
                "Server 99999 not found\n",
            ),
            ("get_active_thread_percentage 99999", "Server 99999 not found\n"),
            ("get_device_pinned_mem_limit 99999 0", "Server 99999 not found\n"),
            (
                "set_device_pinned_mem_limit 99999 0 1G",
                "Server 99999 not found\n",
            ),
            ("get_client_list 99999", "Server 99999 not found\n"),
            ("shutdown_server 99999", "Server 99999 not found\n"),
            ("terminate_client 99999 1", "Server 99999 not found\n"),
            ("get_device_client_list 99999", "Server 99999 not found\n"),
            ("get_device_client_list", ""),
        ];
        for (line, want) in table {
            assert_eq!(run(&mut s, line), want, "{line}");
        }
    }

    #[test]
    fn server_takes_the_defaults_in_force_when_it_starts() {
        let (mut s, _) = state(true, 2);
        run(&mut s, "set_default_active_thread_percentage 25");
        run(&mut s, "set_default_device_pinned_mem_limit 0 4096M");
        let a = s
            .admit_client(604, 0, Arc::new(FakeLink::default()))
            .expect("admit");
        assert_eq!(a.line, "SERVER 607 THREADS 25.0 MEM 0=4G,1=0");
        assert!(a.new_server);
        // Later default changes do not touch the running server.
        run(&mut s, "set_default_active_thread_percentage 30");
        assert_eq!(run(&mut s, "get_active_thread_percentage 607"), "25.0\n");
        assert_eq!(run(&mut s, "get_server_list"), "607\n");
        assert_eq!(run(&mut s, "get_client_list 607"), "604\n");

        assert_eq!(run(&mut s, "set_active_thread_percentage 607 50"), "50.0\n");
        assert_eq!(run(&mut s, "set_active_thread_percentage 607 0"), "50.0\n");
        assert_eq!(run(&mut s, "set_device_pinned_mem_limit 607 0 8192M"), "");
        assert_eq!(run(&mut s, "get_device_pinned_mem_limit 607 0"), "8G\n");
        let b = s
            .admit_client(696, 0, Arc::new(FakeLink::default()))
            .expect("admit");
        assert_eq!(b.line, "SERVER 607 THREADS 50.0 MEM 0=8G,1=0");
        assert!(!b.new_server);
        assert_eq!(run(&mut s, "get_client_list 607"), "604\n696\n");
        assert_eq!(
            run(&mut s, "get_device_client_list"),
            "[0] 00:00.0, FAKE GPU (gpu-mps test double)\n604.1\n696.1\n\
             [1] 01:00.0, FAKE GPU (gpu-mps test double)\n604.1\n696.1\n"
        );

        assert_eq!(s.remove_client(a.client_id), Some(604));
        assert_eq!(run(&mut s, "get_client_list 607"), "696\n");
        assert_eq!(s.remove_client(a.client_id), None);
    }

    #[test]
    fn idle_servers_stay_until_shut_down() {
        let (mut s, record) = state(true, 1);
        let a = s
            .admit_client(1, 0, Arc::new(FakeLink::default()))
            .expect("admit");
        s.remove_client(a.client_id);
        assert_eq!(run(&mut s, "get_server_list"), "607\n");
        assert_eq!(run(&mut s, "shutdown_server 607"), "");
        assert_eq!(run(&mut s, "get_server_list"), "");
        assert_eq!(*record.stopped.lock().expect("lock"), vec![607]);
    }

    #[test]
    fn graceful_shutdown_waits_for_clients_and_force_does_not() {
        let (mut s, record) = state(true, 1);
        let link = Arc::new(FakeLink::default());
        let a = s.admit_client(1, 0, link.clone()).expect("admit");
        run(&mut s, "shutdown_server 607");
        assert_eq!(run(&mut s, "get_server_list"), "607\n");
        // A new client does not join a stopping server.
        let b = s
            .admit_client(2, 0, Arc::new(FakeLink::default()))
            .expect("admit");
        assert_eq!(b.server_pid, 608);
        s.remove_client(a.client_id);
        assert_eq!(run(&mut s, "get_server_list"), "608\n");
        assert!(!link.0.load(Ordering::SeqCst));

        run(&mut s, "shutdown_server 608 -f");
        assert_eq!(run(&mut s, "get_server_list"), "");
        assert_eq!(*record.stopped.lock().expect("lock"), vec![607, 608]);
    }

    #[test]
    fn terminate_client_disconnects_it() {
        let (mut s, _) = state(true, 1);
        let link = Arc::new(FakeLink::default());
        s.admit_client(604, 0, link.clone()).expect("admit");
        assert_eq!(run(&mut s, "terminate_client 607 604"), "");
        assert!(link.0.load(Ordering::SeqCst));
        assert_eq!(run(&mut s, "get_client_list 607"), "");
    }

    #[test]
    fn dead_servers_are_forgotten() {
        let (mut s, record) = state(true, 1);
        let link = Arc::new(FakeLink::default());
        s.admit_client(604, 0, link.clone()).expect("admit");
        record.dead.lock().expect("lock").push(607);
        assert_eq!(run(&mut s, "get_server_list"), "");
        assert!(link.0.load(Ordering::SeqCst));
    }

    #[test]
    fn a_full_server_refuses_clients_and_takes_them_again_when_one_leaves() {
        let (s, _) = state(true, 1);
        let mut s = s.with_max_clients(2);
        let a = s
            .admit_client(1, 0, Arc::new(FakeLink::default()))
            .expect("admit");
        s.admit_client(2, 0, Arc::new(FakeLink::default()))
            .expect("admit");
        let refused = s
            .admit_client(3, 0, Arc::new(FakeLink::default()))
            .expect_err("full");
        assert_eq!(refused, "server 607 already has 2 clients, its limit");
        assert!(!s.has_client(3));
        s.remove_client(a.client_id);
        let c = s
            .admit_client(3, 0, Arc::new(FakeLink::default()))
            .expect("admit");
        assert_eq!(c.server_pid, 607);
    }

    #[test]
    fn has_client_follows_the_clients_of_live_servers() {
        let (mut s, record) = state(true, 1);
        assert!(!s.has_client(604));
        let a = s
            .admit_client(604, 0, Arc::new(FakeLink::default()))
            .expect("admit");
        assert!(s.has_client(604));
        s.remove_client(a.client_id);
        assert!(!s.has_client(604));
        s.admit_client(604, 0, Arc::new(FakeLink::default()))
            .expect("admit");
        record.dead.lock().expect("lock").push(607);
        assert!(!s.has_client(604), "its server died");
    }

    #[test]
    fn one_server_per_user_without_multiuser() {
        let (mut s, _) = state(false, 1);
        let a = s
            .admit_client(1, 0, Arc::new(FakeLink::default()))
            .expect("admit");
        assert!(s.admit_client(2, 1000, Arc::new(FakeLink::default())).is_err());
        s.remove_client(a.client_id);
        let b = s
            .admit_client(2, 1000, Arc::new(FakeLink::default()))
            .expect("admit");
        assert_eq!(b.server_pid, 608);
        assert_eq!(run(&mut s, "get_server_list"), "608\n");

        let (mut m, _) = state(true, 1);
        m.admit_client(1, 0, Arc::new(FakeLink::default()))
            .expect("admit");
        let c = m
            .admit_client(2, 1000, Arc::new(FakeLink::default()))
            .expect("admit");
        assert_eq!(c.server_pid, 607);
    }

    #[test]
    fn start_server_and_quit() {
        let (mut s, record) = state(true, 1);
        assert_eq!(run(&mut s, "start_server -uid 0"), "");
        assert_eq!(run(&mut s, "start_server -uid 0"), "");
        assert_eq!(run(&mut s, "get_server_list"), "607\n");
        assert_eq!(
            s.execute("quit"),
            Reply {
                text: String::new(),
                quit: true
            }
        );
        assert_eq!(*record.stopped.lock().expect("lock"), vec![607]);
    }
}
