//! A synchronous client of the manager API with bounded time: connecting retries until the
//! deadline (the manager may be restarting), and every call carries the remaining time as its
//! ttrpc timeout, so a hung manager can never hang a container create.

use std::path::Path;
use std::time::{Duration, Instant};

use thiserror::Error;

use crate::message::one_line;
use crate::proto;
use crate::proto::manager_ttrpc::ManagerClient;

#[derive(Debug, Error)]
pub enum ClientError {
    #[error(
        "cannot reach gpu-mps-manager at {socket} within {seconds} s: {reason} (is it running? systemctl status gpu-mps-manager)"
    )]
    Unreachable {
        socket: String,
        seconds: u64,
        reason: String,
    },
    #[error(
        "gpu-mps-manager is not running at {socket}: {reason} (systemctl status gpu-mps-manager; journalctl -u gpu-mps-manager)"
    )]
    NotRunning { socket: String, reason: String },
    #[error(
        "gpu-mps-manager did not answer within {seconds} s (is it hung or overloaded? journalctl -u gpu-mps-manager; gpu-mps status)"
    )]
    Timeout { seconds: u64 },
    /// The manager refused: the message is meant for the user as it is.
    #[error("{message}")]
    Refused { code: String, message: String },
    #[error("gpu-mps-manager call failed: {0}")]
    Other(String),
}

pub struct ManagerConnection {
    client: ManagerClient,
    deadline: Instant,
    budget: Duration,
}

impl ManagerConnection {
    pub fn connect(socket: &Path, budget: Duration) -> Result<Self, ClientError> {
        let deadline = Instant::now() + budget;
        let address = format!("unix://{}", socket.display());
        loop {
            match ttrpc::Client::connect(&address) {
                Ok(c) => {
                    return Ok(ManagerConnection {
                        client: ManagerClient::new(c),
                        deadline,
                        budget,
                    });
                }
                Err(e) => {
                    if Instant::now() + Duration::from_millis(200) >= deadline {
                        return Err(ClientError::Unreachable {
                            socket: socket.display().to_string(),
                            seconds: budget.as_secs(),
                            reason: plain_reason(&e.to_string()),
                        });
                    }
                    std::thread::sleep(Duration::from_millis(200));
                }
            }
        }
    }

    /// One attempt, for a person at a terminal: a manager that is not there is said at once
    /// (the hook's [`connect`](Self::connect) keeps trying, as the manager may be restarting).
    /// The calls then get `budget`.
    pub fn connect_once(socket: &Path, budget: Duration) -> Result<Self, ClientError> {
        let unreachable = |reason: String| ClientError::NotRunning {
            socket: socket.display().to_string(),
            reason,
        };
        if !socket.exists() {
            return Err(unreachable("its socket does not exist".into()));
        }
        let client = ttrpc::Client::connect(&format!("unix://{}", socket.display()))
            .map_err(|e| unreachable(plain_reason(&e.to_string())))?;
        Ok(ManagerConnection {
            client: ManagerClient::new(client),
            deadline: Instant::now() + budget,
            budget,
        })
    }

    fn context(&self) -> Result<ttrpc::context::Context, ClientError> {
        let left = self.deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Err(ClientError::Timeout {
                seconds: self.budget.as_secs(),
            });
        }
        Ok(ttrpc::context::with_duration(left))
    }

    fn map_err(&self, e: ttrpc::Error) -> ClientError {
        match e {
            ttrpc::Error::RpcStatus(s) => ClientError::Refused {
                code: format!("{:?}", s.code()),
                message: s.message().to_string(),
            },
            ttrpc::Error::Others(m) if m.contains("timeout") => ClientError::Timeout {
                seconds: self.budget.as_secs(),
            },
            other => ClientError::Other(one_line(&other.to_string())),
        }
    }

    pub fn acquire(&self, req: &proto::AcquireRequest) -> Result<proto::AcquireResponse, ClientError> {
        self.client
            .acquire(self.context()?, req)
            .map_err(|e| self.map_err(e))
    }

    pub fn release(&self, container_id: &str) -> Result<bool, ClientError> {
        let mut req = proto::ReleaseRequest::new();
        req.container_id = container_id.to_string();
        self.client
            .release(self.context()?, &req)
            .map(|r| r.released)
            .map_err(|e| self.map_err(e))
    }

    pub fn status(&self) -> Result<proto::StatusResponse, ClientError> {
        self.client
            .status(self.context()?, &proto::StatusRequest::new())
            .map_err(|e| self.map_err(e))
    }
}

/// An OS error as a person reads it: ttrpc spells one "Nix error: ENOENT: No such file or
/// directory"; the errno name says nothing the words do not.
fn plain_reason(text: &str) -> String {
    let text = one_line(text);
    let tail = text.rsplit_once("Nix error: ").map_or(text.as_str(), |(_, t)| t);
    match tail.split_once(": ") {
        Some((errno, words))
            if errno.len() > 1
                && errno.starts_with('E')
                && errno[1..].bytes().all(|b| b.is_ascii_uppercase()) =>
        {
            words.to_string()
        }
        _ => tail.to_string(),
    }
}

#[cfg(test)]
mod plain_reason_tests {
    use super::plain_reason;

    #[test]
    fn errno_names_give_way_to_words() {
        assert_eq!(
            plain_reason("Nix error: ENOENT: No such file or directory"),
            "No such file or directory"
        );
        assert_eq!(
            plain_reason("Socket connect error Nix error: ECONNREFUSED: Connection refused"),
            "Connection refused"
        );
        assert_eq!(
            plain_reason("something else: entirely"),
            "something else: entirely"
        );
    }

    #[test]
    fn a_missing_socket_is_said_at_once() {
        let dir = tempfile::tempdir().unwrap();
        let started = std::time::Instant::now();
        let e = super::ManagerConnection::connect_once(
            &dir.path().join("manager.sock"),
            std::time::Duration::from_secs(5),
        )
        .err()
        .unwrap()
        .to_string();
        assert!(started.elapsed() < std::time::Duration::from_millis(500));
        assert!(
            e.contains("is not running") && e.contains("does not exist") && !e.contains("ENOENT"),
            "{e}"
        );
        // A socket file nobody listens on.
        let path = dir.path().join("stale.sock");
        drop(std::os::unix::net::UnixListener::bind(&path).unwrap());
        let e = super::ManagerConnection::connect_once(&path, std::time::Duration::from_secs(5))
            .err()
            .unwrap()
            .to_string();
        assert!(started.elapsed() < std::time::Duration::from_secs(1), "{e}");
        assert!(
            e.contains("Connection refused") && !e.contains("Nix error"),
            "{e}"
        );
    }
}
