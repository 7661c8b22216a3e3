//! Registration with kubelet, and noticing that kubelet restarted: it then makes a new
//! kubelet.sock and removes every plugin socket in the directory, and forgets its plugins.

use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::time::Duration;

use hyper_util::rt::TokioIo;
use tokio::net::UnixStream;
use tonic::transport::{Endpoint, Uri};

use crate::v1beta1::registration_client::RegistrationClient;
use crate::v1beta1::{DevicePluginOptions, RegisterRequest, VERSION};

#[derive(Debug, thiserror::Error)]
pub enum LinkError {
    #[error(
        "cannot reach kubelet at {path}: {message} (is kubelet running, and is its device-plugins dir mounted here?)"
    )]
    Connect { path: PathBuf, message: String },
    #[error("kubelet refused the registration of {resource}: {message}")]
    Refused { resource: String, message: String },
}

/// The options the plugin serves with; kubelet reads them at registration.
pub fn options() -> DevicePluginOptions {
    DevicePluginOptions {
        pre_start_required: false,
        get_preferred_allocation_available: true,
    }
}

/// Registers `resource`, served on `endpoint` (a socket name in kubelet's directory).
pub async fn register(kubelet_socket: &Path, endpoint: &str, resource: &str) -> Result<(), LinkError> {
    let path = kubelet_socket.to_path_buf();
    let connect_err = |message: String| LinkError::Connect {
        path: kubelet_socket.to_path_buf(),
        message,
    };
    // The URI is required by the API and ignored by the connector.
    let channel = Endpoint::try_from("http://[::]:0")
        .map_err(|e| connect_err(e.to_string()))?
        .connect_timeout(Duration::from_secs(5))
        .timeout(Duration::from_secs(10))
        .connect_with_connector(tower::service_fn(move |_: Uri| {
            let path = path.clone();
            async move { Ok::<_, std::io::Error>(TokioIo::new(UnixStream::connect(path).await?)) }
        }))
        .await
        .map_err(|e| connect_err(error_chain(&e)))?;
    RegistrationClient::new(channel)
        .register(RegisterRequest {
            version: VERSION.into(),
            endpoint: endpoint.into(),
            resource_name: resource.into(),
            options: Some(options()),
        })
        .await
        .map_err(|status| LinkError::Refused {
            resource: resource.into(),
            message: status.message().to_string(),
        })?;
    Ok(())
}

/// An error and its causes on one line ("transport error: No such file or directory").
fn error_chain(e: &dyn std::error::Error) -> String {
    let mut text = e.to_string();
    let mut source = e.source();
    while let Some(cause) = source {
        text.push_str(": ");
        text.push_str(&cause.to_string());
        source = cause.source();
    }
    text
}

/// A socket file's identity (device, inode), or `None` when it does not exist.
pub fn socket_identity(path: &Path) -> Option<(u64, u64)> {
    std::fs::metadata(path).ok().map(|m| (m.dev(), m.ino()))
}
