//! The ttrpc service on `<root>/manager.sock` and the manager's main loop.

use std::os::unix::fs::PermissionsExt;
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use gpu_mps_api::proto;
use gpu_mps_api::proto::manager_ttrpc::{Manager, create_manager};
use thiserror::Error;
use tracing::{info, warn};
use ttrpc::r#async::TtrpcContext;

use crate::core::{ManagerCore, ManagerError, now_unix};

#[derive(Debug, Error)]
pub enum ServerError {
    #[error("another gpu-mps-manager already serves {0}")]
    AlreadyRunning(String),
    #[error("{context}: {source}")]
    Io { context: String, source: std::io::Error },
    #[error("ttrpc on {socket}: {source}")]
    Ttrpc { socket: String, source: ttrpc::Error },
}

struct Service {
    core: Arc<ManagerCore>,
}

fn to_status(e: ManagerError) -> ttrpc::Error {
    ttrpc::Error::RpcStatus(ttrpc::get_status(e.code(), e.to_string()))
}

#[async_trait]
impl Manager for Service {
    async fn acquire(
        &self,
        _ctx: &TtrpcContext,
        req: proto::AcquireRequest,
    ) -> ttrpc::Result<proto::AcquireResponse> {
        self.core.acquire(req).await.map_err(to_status)
    }

    async fn release(
        &self,
        _ctx: &TtrpcContext,
        req: proto::ReleaseRequest,
    ) -> ttrpc::Result<proto::ReleaseResponse> {
        let released = self.core.release(&req.container_id).await.map_err(to_status)?;
        let mut resp = proto::ReleaseResponse::new();
        resp.released = released;
        Ok(resp)
    }

    async fn status(
        &self,
        _ctx: &TtrpcContext,
        _req: proto::StatusRequest,
    ) -> ttrpc::Result<proto::StatusResponse> {
        Ok(self.core.status().await)
    }
}

/// Makes sure no other manager serves `socket` (one that answers is live: never steal it), and
/// removes a stale socket file. Called before the manager touches any state or GPU.
pub fn claim_socket(socket: &Path) -> Result<(), ServerError> {
    if !socket.exists() {
        return Ok(());
    }
    let socket_str = socket.display().to_string();
    if std::os::unix::net::UnixStream::connect(socket).is_ok() {
        return Err(ServerError::AlreadyRunning(socket_str));
    }
    std::fs::remove_file(socket).map_err(|source| ServerError::Io {
        context: format!("removing stale socket {socket_str}"),
        source,
    })
}

/// Serves the API until SIGTERM or SIGINT, reconciling once a second, then shuts down.
/// `claim_socket` must have been called first.
pub async fn serve(core: Arc<ManagerCore>, socket: &Path) -> Result<(), ServerError> {
    let socket_str = socket.display().to_string();
    let io = |context: String| move |source| ServerError::Io { context, source };
    let mut server = ttrpc::r#async::Server::new()
        .bind(&format!("unix://{socket_str}"))
        .map_err(|source| ServerError::Ttrpc {
            socket: socket_str.clone(),
            source,
        })?
        .register_service(create_manager(Arc::new(Service { core: core.clone() })));
    // Root only: whoever can call Acquire decides limits.
    std::fs::set_permissions(socket, std::fs::Permissions::from_mode(0o600))
        .map_err(io(format!("chmod 0600 {socket_str}")))?;
    server.start().await.map_err(|source| ServerError::Ttrpc {
        socket: socket_str.clone(),
        source,
    })?;
    info!(socket = %socket_str, policy = %core.config().limits.policy, tenancy = %core.config().limits.tenancy, "gpu-mps-manager serving");

    let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())
        .map_err(io("installing the SIGTERM handler".into()))?;
    let mut ticker = tokio::time::interval(Duration::from_secs(1));
    loop {
        tokio::select! {
            _ = ticker.tick() => core.reconcile(now_unix()).await,
            _ = term.recv() => { info!("SIGTERM: shutting down"); break; }
            _ = tokio::signal::ctrl_c() => { info!("SIGINT: shutting down"); break; }
        }
    }
    if let Err(e) = server.shutdown().await {
        warn!(error = %e, "ttrpc shutdown");
    }
    core.shutdown().await;
    let _ = std::fs::remove_file(socket);
    info!("gpu-mps-manager stopped");
    Ok(())
}
