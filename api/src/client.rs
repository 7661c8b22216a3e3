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
                            reason: one_line(&e.to_string()),
                        });
                    }
                    std::thread::sleep(Duration::from_millis(200));
                }
            }
        }
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
