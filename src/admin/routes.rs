//! The admin API's routes: which path answers what, with which methods,
//! on which listener. What guards them: a state change (`POST
//! /backends/state`, `POST /announce/state`) is refused on `admin.listen`
//! (open to every local user) with a 403 that names the socket; a body is
//! read to at most [`MAX_BODY_BYTES`] and parsed strictly (unknown fields
//! refused, the expected shape named); a bad address or state is a 400
//! naming the value. Each answer is built from a short read of the
//! daemon's state: nothing here blocks the forwarder.

use std::net::IpAddr;

use http_body_util::{BodyExt, Either, Full, Limited};
use hyper::body::{Bytes, Incoming};
use hyper::header::{ALLOW, CONTENT_TYPE};
use hyper::{Method, Request, Response, StatusCode};
use serde::Deserialize;
use tokio::sync::{mpsc, oneshot};

use super::{Body, Origin, page};
use crate::daemon::{
    AdminStateError, AnnounceStateError, BackendRequirement, Daemon, ReloadSource, VipNotReady,
};
use crate::dataplane::balancer::AdminState;
use crate::metrics::exposition::ExpositionBody;
use crate::server::ReloadRequest;

/// Largest `POST /backends/state` body accepted; a valid one is ~100 bytes.
const MAX_BODY_BYTES: usize = 4096;

/// Answers one request: the path and method decide, `origin` limits what
/// a TCP caller may do.
pub(super) async fn route(
    req: Request<Incoming>,
    daemon: &Daemon,
    reload: &mpsc::Sender<ReloadRequest>,
    origin: Origin,
    peer: &str,
) -> Response<Body> {
    let path = req.uri().path().to_string();
    let path = path.as_str();
    let allowed: &str = match path {
        "/metrics" | "/healthz" | "/readyz" | "/status" | "/status.html" => "GET, HEAD",
        "/reload" => "POST",
        "/backends/state" if origin == Origin::Tcp => {
            return json_error(
                StatusCode::FORBIDDEN,
                "backend state changes are served only on the admin Unix socket (admin.socket, default /run/harvester-lb/admin.sock), not on admin.listen; use `harvester-lb backend drain|ready|maint --lb NAME ADDRESS` or `curl --unix-socket`",
            );
        }
        "/backends/state" => "POST",
        "/announce/state" if origin == Origin::Tcp => {
            return json_error(
                StatusCode::FORBIDDEN,
                "announce state changes are served only on the admin Unix socket (admin.socket, default /run/harvester-lb/admin.sock), not on admin.listen; use `harvester-lb host drain|ready` or `harvester-lb vip drain|ready VIP`",
            );
        }
        "/announce/state" => "POST",
        "/hand-over" if origin == Origin::Tcp => {
            return json_error(
                StatusCode::FORBIDDEN,
                "a restart is announced only on the admin Unix socket (admin.socket, default /run/harvester-lb/admin.sock), not on admin.listen; the unit's ExecStop= runs `harvester-lb prepare-stop`",
            );
        }
        "/hand-over" => "POST",
        _ => {
            return text(
                StatusCode::NOT_FOUND,
                match origin {
                    Origin::Tcp => {
                        "not found; try /metrics, /healthz, /readyz, /status, /status.html or POST /reload\n"
                    }
                    Origin::Socket => {
                        "not found; try /metrics, /healthz, /readyz, /status, /status.html, POST /reload, POST /backends/state, POST /announce/state or POST /hand-over\n"
                    }
                },
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
            // Counting descriptors can take a while on older kernels: on a
            // blocking thread, not on a worker the data plane shares.
            let (open_fds, process) =
                tokio::task::spawn_blocking(|| (crate::os::open_fds(), crate::os::process_stats()))
                    .await
                    .unwrap_or_default();
            let body = ExpositionBody::from(
                daemon
                    .metrics()
                    .exposition()
                    .with_open_fds(open_fds)
                    .with_process(process),
            );
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
        "/readyz" => readyz(daemon, req.uri().query()),
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
        "/status.html" => status_page(daemon, req.uri().query()).await,
        "/reload" => {
            let (reply, rx) = oneshot::channel();
            let source = match origin {
                Origin::Tcp => ReloadSource::AdminListen,
                Origin::Socket => ReloadSource::AdminSocket,
            };
            if reload.send(ReloadRequest { source, reply }).await.is_err() {
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
        "/backends/state" => set_state(req, daemon, peer).await,
        "/announce/state" => set_announce_state(req, daemon, peer).await,
        "/hand-over" => announce_restart(req, daemon, peer).await,
        _ => text(StatusCode::NOT_FOUND, "not found\n"),
    }
}

/// `/status.html`: the status page of the `/status` document (the page's
/// load balancers of it, see `page`), or 400 naming what is wrong with
/// the query. The document is read under the daemon's lock as for
/// `/status`; turning it into a page (all of it at 10,000 load balancers,
/// then one page of it) runs on a blocking thread, not on the worker the
/// prober and the data plane share.
async fn status_page(daemon: &Daemon, query: Option<&str>) -> Response<Body> {
    let q = match page::parse_query(query.unwrap_or("")) {
        Ok(q) => q,
        Err(e) => return text(StatusCode::BAD_REQUEST, &format!("{e}\n")),
    };
    let doc = daemon.status();
    let rendered = tokio::task::spawn_blocking(move || {
        serde_json::to_value(doc).map(|doc| page::render(&doc, &q))
    })
    .await;
    let html = match rendered {
        Ok(Ok(html)) => html,
        Ok(Err(e)) => {
            return text(
                StatusCode::INTERNAL_SERVER_ERROR,
                &format!("cannot build the status document: {e}\n"),
            );
        }
        Err(e) => {
            return text(
                StatusCode::INTERNAL_SERVER_ERROR,
                &format!("the status page was not rendered: {e}\n"),
            );
        }
    };
    let mut resp = Response::new(Either::Left(Full::new(Bytes::from(html))));
    resp.headers_mut().insert(
        CONTENT_TYPE,
        "text/html; charset=utf-8"
            .parse()
            .expect("static header value"),
    );
    resp
}

/// `/readyz`: the host-wide answer, or with `vip=ADDRESS` (repeatable)
/// the answer for those VIPs alone, or with `vrrp_instance=VRID` the
/// answer for the VIPs the rendered keepalived file puts in that instance
/// (what its track script asks: one short line whatever their number).
fn readyz(daemon: &Daemon, query: Option<&str>) -> Response<Body> {
    let asked = match readyz_query(query.unwrap_or("")) {
        Ok(q) => q,
        Err(e) => return text(StatusCode::BAD_REQUEST, &format!("{e}\n")),
    };
    let verdict = match asked {
        Readyz::Host => {
            if daemon.is_ready() {
                return text(StatusCode::OK, "ready\n");
            }
            let mut body = String::from(if daemon.is_stopping() {
                "stopping\n"
            } else {
                "not ready\n"
            });
            for failed in daemon.failed_listeners() {
                body.push_str(&format!("listener {}: {failed}\n", failed.key.addr));
            }
            return text(StatusCode::SERVICE_UNAVAILABLE, &body);
        }
        Readyz::Vips(vips, require) => daemon.vips_ready(&vips, require),
        Readyz::Instance(vrid, require) => daemon.instance_ready(vrid, require),
    };
    match verdict {
        Ok(()) => text(StatusCode::OK, "ready\n"),
        Err(e @ (VipNotReady::Unknown(_) | VipNotReady::UnknownInstance(_))) => {
            text(StatusCode::NOT_FOUND, &format!("{e}\n"))
        }
        Err(VipNotReady::Unbound(listeners)) => {
            let mut body = String::from("not ready\n");
            for l in listeners {
                body.push_str(&format!("{l}\n"));
            }
            text(StatusCode::SERVICE_UNAVAILABLE, &body)
        }
        Err(e) => text(StatusCode::SERVICE_UNAVAILABLE, &format!("{e}\n")),
    }
}

/// What a `/readyz` query asks about.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Readyz {
    /// No query: the whole host.
    Host,
    /// `vip=ADDRESS`, repeatable (a hand-written keepalived file), and
    /// what `require=` asks beyond bound listeners.
    Vips(Vec<IpAddr>, BackendRequirement),
    /// `vrrp_instance=VRID`, once (the file the daemon renders), and
    /// `require=`.
    Instance(u32, BackendRequirement),
}

/// Why a `/readyz` query cannot be answered (400).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
enum ReadyzQueryError {
    /// A parameter other than `vip` and `vrrp_instance`.
    #[error(
        "unknown query parameter {0:?}; /readyz takes vip=ADDRESS (repeatable), e.g. /readyz?vip=192.168.0.201, or vrrp_instance=VRID, e.g. /readyz?vrrp_instance=50, and optionally require=backend"
    )]
    Parameter(String),
    /// A `require=` value other than `backend` and `bound`.
    #[error(
        "require {0:?} is not a requirement; write require=backend (a listener bound with an eligible backend) or require=bound (bound listeners, the default)"
    )]
    Require(String),
    /// `require=` without `vip=` or `vrrp_instance=`.
    #[error(
        "require= applies to a VIP's readiness; add vip=ADDRESS or vrrp_instance=VRID (plain /readyz asks whether every listener is bound)"
    )]
    RequireAlone,
    /// A `vip=` value that is no address.
    #[error("vip {0:?} is not a VIP address; write e.g. vip=192.168.0.201 or vip=fd00::201")]
    Vip(String),
    /// A `vrrp_instance=` value that is no VRID.
    #[error(
        "vrrp_instance {0:?} is not a VRID; write the instance's virtual_router_id (1..=255), e.g. vrrp_instance=50 for hlb_50"
    )]
    Vrid(String),
    /// `vrrp_instance=` more than once.
    #[error("vrrp_instance is given twice; ask about one instance per request")]
    TwoInstances,
    /// `vip=` with `vrrp_instance=`.
    #[error("vip= and vrrp_instance= together; ask about some VIPs or one instance, not both")]
    Both,
}

/// The question a `/readyz` query asks (`vip=ADDRESS`, repeatable, IPv6
/// bare, in brackets or percent-encoded; or `vrrp_instance=VRID` alone),
/// or what is wrong with it.
fn readyz_query(query: &str) -> Result<Readyz, ReadyzQueryError> {
    let mut vips = Vec::new();
    let mut instance = None;
    let mut require = None;
    for pair in query.split('&').filter(|p| !p.is_empty()) {
        let (key, value) = pair.split_once('=').unwrap_or((pair, ""));
        let value = percent_decode(value);
        match key {
            "vip" => {
                let bare = value
                    .strip_prefix('[')
                    .and_then(|v| v.strip_suffix(']'))
                    .unwrap_or(&value);
                match bare.parse::<IpAddr>() {
                    Ok(ip) if !ip.is_unspecified() => vips.push(ip.to_canonical()),
                    _ => return Err(ReadyzQueryError::Vip(value)),
                }
            }
            "vrrp_instance" => match value.parse::<u8>() {
                Ok(_) if instance.is_some() => return Err(ReadyzQueryError::TwoInstances),
                Ok(vrid) if vrid > 0 => instance = Some(u32::from(vrid)),
                _ => return Err(ReadyzQueryError::Vrid(value)),
            },
            "require" => {
                require = Some(match value.as_str() {
                    "backend" => BackendRequirement::Eligible,
                    "bound" => BackendRequirement::Bound,
                    _ => return Err(ReadyzQueryError::Require(value)),
                })
            }
            _ => return Err(ReadyzQueryError::Parameter(percent_decode(key))),
        }
    }
    let req = require.unwrap_or_default();
    match (instance, vips.is_empty()) {
        (None, true) if require.is_some() => Err(ReadyzQueryError::RequireAlone),
        (None, true) => Ok(Readyz::Host),
        (None, false) => Ok(Readyz::Vips(vips, req)),
        (Some(vrid), true) => Ok(Readyz::Instance(vrid, req)),
        (Some(_), false) => Err(ReadyzQueryError::Both),
    }
}

/// `%XX` escapes decoded; anything else as it is.
pub(super) fn percent_decode(s: &str) -> String {
    let bytes = s.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        let hex = bytes
            .get(i + 1..i + 3)
            .filter(|h| h.iter().all(u8::is_ascii_hexdigit))
            .and_then(|h| std::str::from_utf8(h).ok())
            .and_then(|h| u8::from_str_radix(h, 16).ok());
        match (bytes[i], hex) {
            (b'%', Some(b)) => {
                out.push(b);
                i += 3;
            }
            (b, _) => {
                out.push(b);
                i += 1;
            }
        }
    }
    String::from_utf8_lossy(&out).into_owned()
}

/// The body of `POST /backends/state`.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct StateRequest {
    /// `<namespace>/<service>`.
    load_balancer: String,
    /// The backend's address, as in the config.
    backend: String,
    /// `ready`, `drain` or `maint`.
    state: String,
}

/// What a valid body looks like, for error messages.
const STATE_BODY_SHAPE: &str = r#"{"load_balancer": "<namespace>/<service>", "backend": "<address>", "state": "ready|drain|maint"}"#;

async fn set_state(req: Request<Incoming>, daemon: &Daemon, peer: &str) -> Response<Body> {
    let request: StateRequest = match read_json(req, STATE_BODY_SHAPE).await {
        Ok(r) => r,
        Err(resp) => return resp,
    };
    let Some(state) = AdminState::parse(&request.state) else {
        return json_error(
            StatusCode::BAD_REQUEST,
            &format!(
                "state {:?} is not one of \"ready\", \"drain\", \"maint\"",
                request.state
            ),
        );
    };
    let Ok(addr) = request.backend.trim().parse::<IpAddr>() else {
        return json_error(
            StatusCode::BAD_REQUEST,
            &format!(
                "backend {:?} is not an IP address; name the backend as in the config, e.g. \"10.52.0.11\"",
                request.backend
            ),
        );
    };
    // As the config does: an IPv4-mapped address is the IPv4 node.
    let addr = addr.to_canonical();
    match daemon.set_admin_state(&request.load_balancer, addr, state) {
        Ok(change) => {
            tracing::info!(
                load_balancer = &*request.load_balancer,
                backend = %addr,
                from = %change.previous,
                to = %change.state,
                peer,
                "admin state set through the admin socket"
            );
            json(
                StatusCode::OK,
                &serde_json::json!({
                    "load_balancer": request.load_balancer,
                    "backend": addr,
                    "state": change.state,
                    "previous_state": change.previous,
                }),
            )
        }
        Err(e @ (AdminStateError::UnknownLoadBalancer(_) | AdminStateError::NotAMember { .. })) => {
            json_error(StatusCode::NOT_FOUND, &e.to_string())
        }
    }
}

/// A request's JSON body (at most [`MAX_BODY_BYTES`]), or the 400 answer
/// that says what is wrong and what `shape` is expected.
async fn read_json<T: serde::de::DeserializeOwned>(
    req: Request<Incoming>,
    shape: &str,
) -> Result<T, Response<Body>> {
    let body = match Limited::new(req.into_body(), MAX_BODY_BYTES)
        .collect()
        .await
    {
        Ok(b) => b.to_bytes(),
        Err(e) => {
            return Err(json_error(
                StatusCode::BAD_REQUEST,
                &format!("cannot read the request body (at most {MAX_BODY_BYTES} bytes): {e}"),
            ));
        }
    };
    serde_json::from_slice(&body).map_err(|e| {
        json_error(
            StatusCode::BAD_REQUEST,
            &format!("bad request body: {e}; expected {shape}"),
        )
    })
}

/// The body of `POST /announce/state`.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct AnnounceRequest {
    /// One VIP; absent: the whole host.
    vip: Option<String>,
    /// `drain` or `ready`.
    state: String,
}

/// `POST /hand-over`: the restart `prepare-stop` announces.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct HandOverRequest {
    /// The unit's `FileDescriptorStoreMax=`, when prepare-stop read it.
    store_max: Option<usize>,
}

/// What a valid `/hand-over` body looks like, for error messages.
const HAND_OVER_BODY_SHAPE: &str = r#"{} or {"store_max": <FileDescriptorStoreMax>}"#;

/// `POST /hand-over` (socket only): the next SIGTERM, within
/// `daemon::INTENT_BOUND`, hands the sockets to the next process instead of
/// draining; 409 with the reason when that cannot be done (the stop drains).
async fn announce_restart(req: Request<Incoming>, daemon: &Daemon, peer: &str) -> Response<Body> {
    let request: HandOverRequest = match read_json(req, HAND_OVER_BODY_SHAPE).await {
        Ok(r) => r,
        Err(resp) => return resp,
    };
    tracing::info!(
        peer,
        store_max = request.store_max,
        "restart announced through the admin socket"
    );
    match daemon.announce_restart(request.store_max) {
        Ok(bound) => json(
            StatusCode::OK,
            &serde_json::json!({
                "stop": "hand-over",
                "expires_in_seconds": bound.as_secs(),
                "stored_fds": daemon.fd_store().stored_fds(),
            }),
        ),
        Err(why) => json(
            StatusCode::CONFLICT,
            &serde_json::json!({
                "stop": "drain",
                "reason": why.reason().label(),
                "error": why.to_string(),
            }),
        ),
    }
}

/// What a valid body looks like, for error messages.
const ANNOUNCE_BODY_SHAPE: &str =
    r#"{"state": "drain|ready"} or {"vip": "<address>", "state": "drain|ready"}"#;

async fn set_announce_state(req: Request<Incoming>, daemon: &Daemon, peer: &str) -> Response<Body> {
    let request: AnnounceRequest = match read_json(req, ANNOUNCE_BODY_SHAPE).await {
        Ok(r) => r,
        Err(resp) => return resp,
    };
    let drained = match request.state.as_str() {
        "drain" => true,
        "ready" => false,
        other => {
            return json_error(
                StatusCode::BAD_REQUEST,
                &format!("state {other:?} is not one of \"drain\", \"ready\""),
            );
        }
    };
    let vip = match request.vip.as_deref().map(|v| v.trim().parse::<IpAddr>()) {
        None => None,
        Some(Ok(ip)) => Some(ip.to_canonical()),
        Some(Err(_)) => {
            return json_error(
                StatusCode::BAD_REQUEST,
                &format!(
                    "vip {:?} is not an IP address; name the VIP as in the config, e.g. \"192.168.0.201\"",
                    request.vip.unwrap_or_default()
                ),
            );
        }
    };
    match daemon.set_announce_state(vip, drained) {
        Ok(change) => {
            tracing::info!(
                vip = vip.map(|v| v.to_string()),
                from = change.previous,
                to = change.state,
                peer,
                "announce state set through the admin socket"
            );
            let mut answer = serde_json::json!({
                "state": change.state,
                "previous_state": change.previous,
            });
            if let Some(v) = vip {
                answer["vip"] = serde_json::json!(v);
            }
            json(StatusCode::OK, &answer)
        }
        Err(e @ AnnounceStateError::UnknownVip(_)) => {
            json_error(StatusCode::NOT_FOUND, &e.to_string())
        }
        Err(e @ AnnounceStateError::Off) => json_error(StatusCode::CONFLICT, &e.to_string()),
    }
}

fn json(status: StatusCode, value: &serde_json::Value) -> Response<Body> {
    let mut body = serde_json::to_vec(value).unwrap_or_else(|_| b"{}".to_vec());
    body.push(b'\n');
    let mut resp = Response::new(Either::Left(Full::new(Bytes::from(body))));
    *resp.status_mut() = status;
    resp.headers_mut().insert(
        CONTENT_TYPE,
        "application/json".parse().expect("static header value"),
    );
    resp
}

fn json_error(status: StatusCode, message: &str) -> Response<Body> {
    json(status, &serde_json::json!({ "error": message }))
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn readyz_query_names_vips_in_every_spelling_and_refuses_the_rest() {
        let readyz_vips = |q: &str| {
            readyz_query(q).map_err(|e| e.to_string()).map(|r| match r {
                Readyz::Host => vec![],
                Readyz::Vips(v, BackendRequirement::Bound) => v,
                other => panic!("{q}: {other:?}"),
            })
        };
        let v4: IpAddr = "192.168.0.201".parse().unwrap();
        let v6: IpAddr = "fd00::201".parse().unwrap();
        assert_eq!(readyz_vips(""), Ok(vec![]));
        assert_eq!(readyz_vips("vip=192.168.0.201"), Ok(vec![v4]));
        // IPv4-mapped is the IPv4 VIP, as in the config.
        assert_eq!(readyz_vips("vip=::ffff:192.168.0.201"), Ok(vec![v4]));
        for spelled in [
            "vip=fd00::201",
            "vip=[fd00::201]",
            "vip=%5Bfd00%3A%3A201%5D",
        ] {
            assert_eq!(readyz_vips(spelled), Ok(vec![v6]), "{spelled}");
        }
        assert_eq!(
            readyz_vips("vip=192.168.0.201&vip=fd00::201"),
            Ok(vec![v4, v6])
        );
        for bad in ["vip=", "vip=0.0.0.0", "vip=::", "vip=10.0.0.300", "vip=%ZZ"] {
            let e = readyz_vips(bad).unwrap_err();
            assert!(e.contains("is not a VIP address"), "{bad}: {e}");
        }
        let e = readyz_vips("vip=192.168.0.201&host=x").unwrap_err();
        assert!(e.contains("\"host\"") && e.contains("vip=ADDRESS"), "{e}");
    }

    #[test]
    fn readyz_query_takes_require_backend_with_a_vip_or_an_instance_only() {
        let v4: IpAddr = "192.168.0.201".parse().unwrap();
        assert_eq!(
            readyz_query("vip=192.168.0.201&require=backend"),
            Ok(Readyz::Vips(vec![v4], BackendRequirement::Eligible))
        );
        assert_eq!(
            readyz_query("require=bound&vip=192.168.0.201"),
            Ok(Readyz::Vips(vec![v4], BackendRequirement::Bound))
        );
        assert_eq!(
            readyz_query("vrrp_instance=50&require=backend"),
            Ok(Readyz::Instance(50, BackendRequirement::Eligible))
        );
        assert_eq!(
            readyz_query("require=backend"),
            Err(ReadyzQueryError::RequireAlone)
        );
        let e = readyz_query("vip=192.168.0.201&require=backends")
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("\"backends\"") && e.contains("require=backend"),
            "{e}"
        );
    }

    #[test]
    fn readyz_query_names_one_vrrp_instance_by_its_vrid() {
        assert_eq!(
            readyz_query("vrrp_instance=50"),
            Ok(Readyz::Instance(50, BackendRequirement::Bound))
        );
        assert_eq!(
            readyz_query("vrrp_instance=255"),
            Ok(Readyz::Instance(255, BackendRequirement::Bound))
        );
        for bad in [
            "vrrp_instance=",
            "vrrp_instance=0",
            "vrrp_instance=256",
            "vrrp_instance=hlb_50",
            "vrrp_instance=-1",
        ] {
            let e = readyz_query(bad).unwrap_err().to_string();
            assert!(e.contains("is not a VRID"), "{bad}: {e}");
        }
        assert_eq!(
            readyz_query("vrrp_instance=50&vrrp_instance=51"),
            Err(ReadyzQueryError::TwoInstances)
        );
        assert_eq!(
            readyz_query("vrrp_instance=50&vip=192.168.0.201"),
            Err(ReadyzQueryError::Both)
        );
    }
}
