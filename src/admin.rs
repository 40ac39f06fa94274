//! The admin HTTP server: `/metrics`, `/healthz`, `/readyz`, `/status`, and
//! `POST /reload`.
//!
//! It runs on its own listener, bounded in every way a hostile or broken
//! client could push it (connections, header size, time to send headers), and
//! it never blocks the forwarder: the only shared things it touches are the
//! metric registry and a short read of the daemon's state.

use std::convert::Infallible;
use std::sync::Arc;
use std::time::Duration;

use http_body_util::{Either, Full};
use hyper::body::{Bytes, Incoming};
use hyper::header::{ALLOW, CONTENT_TYPE};
use hyper::{Method, Request, Response, StatusCode};
use hyper_util::rt::{TokioIo, TokioTimer};
use tokio::net::TcpListener;
use tokio::sync::{Semaphore, mpsc, oneshot};
use tokio_util::sync::CancellationToken;

use crate::daemon::Daemon;
use crate::metrics::exposition::ExpositionBody;

/// A response body: a short text or JSON, or `/metrics` written as it is sent.
type Body = Either<Full<Bytes>, ExpositionBody>;

/// Admin connections served at once; more wait in the kernel's backlog.
const MAX_CONNECTIONS: usize = 64;
/// Largest request head accepted (hyper answers 431 beyond it).
const MAX_HEAD_BYTES: usize = 16 * 1024;
/// Time a client gets to send its request head.
const HEADER_TIMEOUT: Duration = Duration::from_secs(5);

/// A request to reload the config, answered with the outcome.
pub type ReloadRequest = oneshot::Sender<Result<String, String>>;

/// Serves the admin API on `listener` until `stop` is cancelled.
pub async fn serve(
    listener: TcpListener,
    daemon: Arc<Daemon>,
    reload: mpsc::Sender<ReloadRequest>,
    stop: CancellationToken,
) {
    let slots = Arc::new(Semaphore::new(MAX_CONNECTIONS));
    loop {
        let Ok(permit) = Arc::clone(&slots).acquire_owned().await else {
            return;
        };
        let accepted = tokio::select! {
            _ = stop.cancelled() => return,
            r = listener.accept() => r,
        };
        let (stream, peer) = match accepted {
            Ok(a) => a,
            Err(e) => {
                tracing::debug!(error = %e, "admin accept failed");
                tokio::time::sleep(Duration::from_millis(50)).await;
                continue;
            }
        };
        let daemon = Arc::clone(&daemon);
        let reload = reload.clone();
        let stop = stop.clone();
        tokio::spawn(async move {
            let _permit = permit;
            let service = hyper::service::service_fn(move |req| {
                let daemon = Arc::clone(&daemon);
                let reload = reload.clone();
                async move { Ok::<_, Infallible>(route(req, &daemon, &reload).await) }
            });
            let conn = hyper::server::conn::http1::Builder::new()
                .timer(TokioTimer::new())
                .header_read_timeout(HEADER_TIMEOUT)
                .max_buf_size(MAX_HEAD_BYTES)
                .keep_alive(true)
                .serve_connection(TokioIo::new(stream), service);
            tokio::pin!(conn);
            tokio::select! {
                r = conn.as_mut() => if let Err(e) = r {
                    tracing::debug!(client = %peer, error = %e, "admin connection ended with an error");
                },
                _ = stop.cancelled() => {}
            }
        });
    }
}

async fn route(
    req: Request<Incoming>,
    daemon: &Daemon,
    reload: &mpsc::Sender<ReloadRequest>,
) -> Response<Body> {
    let path = req.uri().path();
    let allowed: &str = match path {
        "/metrics" | "/healthz" | "/readyz" | "/status" => "GET, HEAD",
        "/reload" => "POST",
        _ => {
            return text(
                StatusCode::NOT_FOUND,
                "not found; try /metrics, /healthz, /readyz, /status or POST /reload\n",
            );
        }
    };
    let method_ok = match *req.method() {
        Method::GET | Method::HEAD => allowed.contains("GET"),
        Method::POST => allowed == "POST",
        _ => false,
    };
    if !method_ok {
        let mut resp = text(
            StatusCode::METHOD_NOT_ALLOWED,
            &format!("method not allowed; use {allowed}\n"),
        );
        resp.headers_mut()
            .insert(ALLOW, allowed.parse().expect("static header value"));
        return resp;
    }
    match path {
        "/metrics" => {
            let body = ExpositionBody::from(daemon.metrics().exposition());
            let mut resp = Response::new(Either::Right(body));
            resp.headers_mut().insert(
                CONTENT_TYPE,
                "text/plain; version=0.0.4; charset=utf-8"
                    .parse()
                    .expect("static header value"),
            );
            resp
        }
        "/healthz" => text(StatusCode::OK, "ok\n"),
        "/readyz" => {
            if daemon.is_ready() {
                text(StatusCode::OK, "ready\n")
            } else {
                let failed = daemon.failed_listeners();
                let mut body = String::from(if daemon.is_stopping() {
                    "stopping\n"
                } else {
                    "not ready\n"
                });
                for (addr, why) in failed {
                    body.push_str(&format!("listener {addr}: {why}\n"));
                }
                text(StatusCode::SERVICE_UNAVAILABLE, &body)
            }
        }
        "/status" => {
            let body = serde_json::to_vec_pretty(&daemon.status())
                .unwrap_or_else(|e| format!("{{\"error\":\"{e}\"}}").into_bytes());
            let mut resp = Response::new(Either::Left(Full::new(Bytes::from(body))));
            resp.headers_mut().insert(
                CONTENT_TYPE,
                "application/json".parse().expect("static header value"),
            );
            resp
        }
        "/reload" => {
            let (tx, rx) = oneshot::channel();
            if reload.send(tx).await.is_err() {
                return text(StatusCode::SERVICE_UNAVAILABLE, "the daemon is stopping\n");
            }
            match rx.await {
                Ok(Ok(summary)) => text(StatusCode::OK, &format!("{summary}\n")),
                Ok(Err(problems)) => {
                    text(StatusCode::UNPROCESSABLE_ENTITY, &format!("{problems}\n"))
                }
                Err(_) => text(StatusCode::SERVICE_UNAVAILABLE, "the daemon is stopping\n"),
            }
        }
        _ => unreachable!("paths were matched above"),
    }
}

fn text(status: StatusCode, body: &str) -> Response<Body> {
    let mut resp = Response::new(Either::Left(Full::new(Bytes::from(body.to_string()))));
    *resp.status_mut() = status;
    resp.headers_mut().insert(
        CONTENT_TYPE,
        "text/plain; charset=utf-8"
            .parse()
            .expect("static header value"),
    );
    resp
}
