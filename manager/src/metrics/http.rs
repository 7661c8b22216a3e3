//! `GET /metrics` over HTTP/1.1 on `[metrics] listen`: every other path is 404, every other
//! method on it 405. Few connections at once, each with a bounded life, so that a client that
//! holds connections open can never make the manager run out of descriptors.

use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use http_body_util::Full;
use hyper::body::{Bytes, Incoming};
use hyper::header::{ACCEPT, ALLOW, CONTENT_TYPE, HeaderValue};
use hyper::server::conn::http1;
use hyper::service::service_fn;
use hyper::{Method, Request, Response, StatusCode};
use hyper_util::rt::{TokioIo, TokioTimer};
use thiserror::Error;
use tokio::net::TcpListener;
use tokio::sync::Semaphore;
use tracing::{debug, info, warn};

use super::{Exposition, Format};

pub const METRICS_PATH: &str = "/metrics";

/// Connections served at once; more wait in the listen backlog. A Prometheus server keeps one;
/// an idle connection costs a task and a socket, so the cap is high enough that a few clients
/// holding connections open cannot starve the scraper (and a NetworkPolicy is the real fence).
const MAX_CONNECTIONS: usize = 64;
/// Longest a client may take to send a request's headers (also how long an idle connection may
/// hold a slot before its next request).
const HEADER_TIMEOUT: Duration = Duration::from_secs(5);
/// Longest life of one connection (Prometheus opens a new one when it is closed).
const CONNECTION_LIFETIME: Duration = Duration::from_secs(120);

#[derive(Debug, Error)]
pub enum MetricsError {
    #[error(
        "cannot serve metrics on {address} ([metrics] listen in the node config): {source}; the manager goes on without metrics"
    )]
    Bind {
        address: SocketAddr,
        source: std::io::Error,
    },
}

/// Binds the metrics address. Apart from [`serve`] so that the manager binds it before it
/// starts serving leases (a clash is logged early, next to the config it comes from).
pub async fn bind(address: SocketAddr) -> Result<TcpListener, MetricsError> {
    TcpListener::bind(address)
        .await
        .map_err(|source| MetricsError::Bind { address, source })
}

/// Serves scrapes on `listener` for as long as the task runs.
pub async fn serve(listener: TcpListener, exposition: Arc<Exposition>) {
    if let Ok(address) = listener.local_addr() {
        info!(address = %address, path = METRICS_PATH, "serving Prometheus metrics");
    }
    let slots = Arc::new(Semaphore::new(MAX_CONNECTIONS));
    let mut http = http1::Builder::new();
    http.timer(TokioTimer::new()).header_read_timeout(HEADER_TIMEOUT);
    loop {
        let Ok(slot) = slots.clone().acquire_owned().await else {
            return;
        };
        let (stream, peer) = match listener.accept().await {
            Ok(accepted) => accepted,
            Err(e) => {
                // Out of descriptors, most likely: back off instead of spinning.
                warn!(error = %e, "metrics: cannot accept a connection");
                tokio::time::sleep(Duration::from_millis(100)).await;
                continue;
            }
        };
        let exposition = exposition.clone();
        let connection = http.serve_connection(
            TokioIo::new(stream),
            service_fn(move |request| {
                let exposition = exposition.clone();
                async move { Ok::<_, Infallible>(answer(&request, &exposition)) }
            }),
        );
        tokio::spawn(async move {
            match tokio::time::timeout(CONNECTION_LIFETIME, connection).await {
                Ok(Ok(())) => {}
                Ok(Err(e)) => debug!(peer = %peer, error = %e, "metrics: connection ended"),
                Err(_) => debug!(peer = %peer, "metrics: connection closed after its lifetime"),
            }
            drop(slot);
        });
    }
}

/// The answer to one request.
fn answer(request: &Request<Incoming>, exposition: &Exposition) -> Response<Full<Bytes>> {
    let accept = request
        .headers()
        .get(ACCEPT)
        .and_then(|value| value.to_str().ok());
    respond(request.method(), request.uri().path(), accept, exposition)
}

/// Pure routing: what `method path` with `accept` gets.
pub fn respond(
    method: &Method,
    path: &str,
    accept: Option<&str>,
    exposition: &Exposition,
) -> Response<Full<Bytes>> {
    if path != METRICS_PATH {
        return plain(StatusCode::NOT_FOUND, "not found: the metrics are at /metrics\n");
    }
    if method != Method::GET && method != Method::HEAD {
        let mut response = plain(StatusCode::METHOD_NOT_ALLOWED, "only GET and HEAD\n");
        response
            .headers_mut()
            .insert(ALLOW, HeaderValue::from_static("GET, HEAD"));
        return response;
    }
    let format = Format::from_accept(accept);
    let started = Instant::now();
    let text = match exposition.encode(format) {
        Ok(text) => text,
        Err(e) => {
            warn!(error = %e, "metrics: encoding failed");
            return plain(
                StatusCode::INTERNAL_SERVER_ERROR,
                "the metrics could not be encoded\n",
            );
        }
    };
    debug!(
        ?format,
        bytes = text.len(),
        elapsed_us = started.elapsed().as_micros() as u64,
        "metrics scraped"
    );
    let mut response = Response::new(Full::new(Bytes::from(text)));
    response
        .headers_mut()
        .insert(CONTENT_TYPE, HeaderValue::from_static(format.content_type()));
    response
}

fn plain(status: StatusCode, text: &'static str) -> Response<Full<Bytes>> {
    let mut response = Response::new(Full::new(Bytes::from_static(text.as_bytes())));
    *response.status_mut() = status;
    response.headers_mut().insert(
        CONTENT_TYPE,
        HeaderValue::from_static("text/plain; charset=utf-8"),
    );
    response
}
