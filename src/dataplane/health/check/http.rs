//! The HTTP check: one `GET` per probe on a connection of its own, the way
//! a load balancer in front of `externalTrafficPolicy: Local` services asks
//! kube-proxy's `healthCheckNodePort` whether the node has a ready endpoint
//! (200 with a JSON body if so, 503 if not).
//!
//! The whole exchange is bounded: the probe's timeout covers connect and
//! answer, the response head may be [`MAX_HEAD_BYTES`] at most, and only the
//! status is judged (kube-proxy's verdict is the status; its body repeats it
//! as `localEndpoints`). The body is read and thrown away until the server
//! closes, as `Connection: close` asks it to, so that the server closes
//! first and the connection ends with a FIN each way: the node's server sees
//! a clean request, and the `TIME_WAIT` stays with the server that closed,
//! as for any HTTP/1.0-style client.

use std::net::SocketAddr;
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;
use tokio::time::{Instant, timeout_at};

use super::{Outcome, classify};
use crate::config::{HttpCheck, StatusSet};
use crate::net;

/// The largest response head read (status line and header fields). kube-
/// proxy's is about 150 bytes; a head that does not end within this is not
/// a health endpoint's answer, and the probe must not buffer without bound.
pub const MAX_HEAD_BYTES: usize = 4096;

/// Header fields parsed at most; more is a malformed answer.
const MAX_HEADERS: usize = 64;

/// Body bytes read and discarded, at most, while waiting for the server to
/// close. Past this the probe closes anyway (the verdict is already known).
const MAX_DRAIN_BYTES: usize = 64 * 1024;

/// The PROXY protocol v2 header a probe sends first with `send_proxy`: the
/// `LOCAL` command, no addresses (the connection is the load balancer's
/// own, and the node is to use its real endpoints). Sent in the same write
/// as the request.
pub fn local_proxy_header() -> Vec<u8> {
    use ppp::v2::{Addresses, Builder, Command, Protocol, Version};
    Builder::with_addresses(
        Version::Two | Command::Local,
        Protocol::Unspecified,
        Addresses::Unspecified,
    )
    .build()
    // Only a payload over 64 KiB can fail; this one is empty.
    .unwrap_or_default()
}

/// The request line and headers sent, exactly; with `send_proxy` the
/// PROXY header goes before them and nothing else is sent.
pub fn request_head(check: &HttpCheck, target: SocketAddr) -> String {
    // `SocketAddr`'s display puts an IPv6 address in brackets, as a Host
    // header needs it.
    let host = match &check.host {
        Some(host) => host.clone(),
        None => target.to_string(),
    };
    format!(
        "GET {} HTTP/1.1\r\nHost: {host}\r\nUser-Agent: harvester-lb/{}\r\nConnection: close\r\n\r\n",
        check.path,
        env!("CARGO_PKG_VERSION")
    )
}

/// Runs one HTTP probe of `target` within `timeout`; returns the outcome and
/// when it was known (the body drained after that is not the probe's time).
pub(super) async fn get(
    check: &HttpCheck,
    target: SocketAddr,
    timeout: Duration,
) -> (Outcome, Instant) {
    let deadline = Instant::now() + timeout;
    let socket = match net::tcp_socket_for(target) {
        Ok(s) => s,
        Err(e) if net::is_local_shortage(&e) => {
            let outcome = Outcome::Skipped(format!("cannot create probe socket: {e}"));
            return (outcome, Instant::now());
        }
        Err(e) => {
            let outcome = Outcome::Error(format!("cannot create probe socket: {e}"));
            return (outcome, Instant::now());
        }
    };
    let mut stream = match timeout_at(deadline, net::connect(socket, target)).await {
        Ok(Ok(stream)) => stream,
        Ok(Err(e)) => return (classify(e), Instant::now()),
        Err(_) => return (Outcome::Timeout, Instant::now()),
    };
    let mut buf = vec![0u8; MAX_HEAD_BYTES];
    let mut request = if check.send_proxy {
        local_proxy_header()
    } else {
        Vec::new()
    };
    request.extend_from_slice(request_head(check, target).as_bytes());
    let exchange = exchange(&mut stream, &request, &mut buf, &check.expect_status);
    let (outcome, answered) = match timeout_at(deadline, exchange).await {
        Ok(result) => result,
        Err(_) => (Outcome::Timeout, false),
    };
    let known = Instant::now();
    if answered {
        // Whatever happens here, the verdict stands: a server that keeps
        // the connection open or sends an endless body is closed on.
        let _ = timeout_at(deadline, drain(&mut stream, &mut buf)).await;
    }
    // Dropped: closed, with a FIN when every byte received was read.
    (outcome, known)
}

/// Sends `request`, reads the response head into `buf` and judges its
/// status. Returns the outcome and whether a complete head arrived (so the
/// rest of the answer is to be drained before closing).
async fn exchange(
    stream: &mut TcpStream,
    request: &[u8],
    buf: &mut [u8],
    expect: &StatusSet,
) -> (Outcome, bool) {
    if let Err(e) = stream.write_all(request).await {
        return (
            Outcome::HttpError(format!(
                "connection failed before the request was sent: {e}"
            )),
            false,
        );
    }
    let mut filled = 0;
    // Set when bytes after a 1xx interim head are still to be parsed.
    let mut pending = false;
    loop {
        if !pending {
            let n = match stream.read(&mut buf[filled..]).await {
                Ok(n) => n,
                Err(e) => {
                    let outcome = Outcome::HttpError(format!(
                        "connection failed after {filled} bytes of the answer, before a complete response head: {e}"
                    ));
                    return (outcome, false);
                }
            };
            if n == 0 {
                let outcome = Outcome::HttpError(if filled == 0 {
                    "connection closed before a status line".into()
                } else {
                    format!(
                        "connection closed before the end of the response head (after {filled} bytes: {})",
                        excerpt(&buf[..filled])
                    )
                });
                return (outcome, false);
            }
            filled += n;
        }
        pending = false;
        let mut headers = [httparse::EMPTY_HEADER; MAX_HEADERS];
        let mut response = httparse::Response::new(&mut headers);
        match response.parse(&buf[..filled]) {
            Ok(httparse::Status::Complete(len)) => {
                // A complete head always has a code.
                let status = response.code.unwrap_or(0);
                if (100..200).contains(&status) && status != 101 {
                    // An interim answer (100 Continue, 103 Early Hints): the
                    // verdict is in the final one that follows.
                    buf.copy_within(len..filled, 0);
                    filled -= len;
                    pending = filled > 0;
                    continue;
                }
                if expect.contains(status) {
                    return (Outcome::Ok, true);
                }
                let reason = response
                    .reason
                    .filter(|r| !r.is_empty())
                    .map(|r| format!(" {}", shorten(r.as_bytes())))
                    .unwrap_or_default();
                let detail = format!("HTTP status {status}{reason}; expected {expect}");
                return (Outcome::HttpStatus { status, detail }, true);
            }
            Ok(httparse::Status::Partial) if filled == buf.len() => {
                let outcome = Outcome::HttpError(format!(
                    "response head longer than {} bytes (starts {})",
                    buf.len(),
                    excerpt(&buf[..filled])
                ));
                return (outcome, false);
            }
            Ok(httparse::Status::Partial) => {}
            Err(e) => {
                let outcome = Outcome::HttpError(format!(
                    "malformed response head ({e}): {}",
                    excerpt(&buf[..filled])
                ));
                return (outcome, false);
            }
        }
    }
}

/// Reads and discards the rest of the answer until the server closes, at
/// most [`MAX_DRAIN_BYTES`].
async fn drain(stream: &mut TcpStream, buf: &mut [u8]) {
    let mut read = 0;
    while read <= MAX_DRAIN_BYTES {
        match stream.read(buf).await {
            Ok(0) | Err(_) => return,
            Ok(n) => read += n,
        }
    }
}

/// The first line of an answer (at most 80 bytes), quoted and escaped, so a
/// log line shows what the server sent without carrying its control bytes.
fn excerpt(bytes: &[u8]) -> String {
    let line = bytes.split(|&b| b == b'\n').next().unwrap_or_default();
    format!("\"{}\"", shorten(line))
}

/// `bytes` escaped as ASCII, cut to 80 bytes of input with an ellipsis.
fn shorten(bytes: &[u8]) -> String {
    let cut = bytes.len().min(80);
    let mut out = bytes[..cut].escape_ascii().to_string();
    if cut < bytes.len() {
        out.push('…');
    }
    out
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use tokio::net::TcpListener;

    use super::*;
    use crate::config::CheckKind;
    use crate::dataplane::health::check::{ProbeSockets, probe};

    fn check(path: &str, host: Option<&str>, expect: &[(u16, u16)]) -> CheckKind {
        CheckKind::Http(Arc::new(HttpCheck {
            path: path.into(),
            host: host.map(Into::into),
            expect_status: StatusSet::new(expect.iter().copied()),
            send_proxy: false,
        }))
    }

    /// A server on `ip` that answers one connection with `answer` (after
    /// reading the request head) and returns what it received.
    async fn one_answer(
        ip: &str,
        answer: &'static [u8],
    ) -> (SocketAddr, tokio::task::JoinHandle<Vec<u8>>) {
        let listener = TcpListener::bind((ip, 0)).await.unwrap();
        let addr = listener.local_addr().unwrap();
        let task = tokio::spawn(async move {
            let (mut s, _) = listener.accept().await.unwrap();
            let mut got = Vec::new();
            let mut buf = [0u8; 1024];
            while !got.ends_with(b"\r\n\r\n") {
                let n = s.read(&mut buf).await.unwrap();
                if n == 0 {
                    break;
                }
                got.extend_from_slice(&buf[..n]);
            }
            s.write_all(answer).await.unwrap();
            s.shutdown().await.unwrap();
            // Until the probe closes too: a clean end on both sides.
            let n = s.read(&mut buf).await.unwrap();
            assert_eq!(n, 0, "the probe sends nothing after its request");
            got
        });
        (addr, task)
    }

    const KUBE_PROXY_503: &[u8] = b"HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\nX-Content-Type-Options: nosniff\r\nDate: Mon, 23 Nov 2026 05:00:00 GMT\r\nContent-Length: 103\r\nConnection: close\r\n\r\n{\"service\":{\"namespace\":\"default\",\"name\":\"web\"},\"localEndpoints\":0,\"serviceProxyHealthy\":true}\n          ";

    #[tokio::test]
    async fn the_request_is_exact_and_the_status_is_judged() {
        let sockets = ProbeSockets::new();
        let t = Duration::from_secs(5);
        let (addr, server) = one_answer("127.0.0.1", KUBE_PROXY_503).await;
        let (outcome, _) = probe(&check("/healthz", None, &[(200, 200)]), addr, t, &sockets).await;
        assert_eq!(
            outcome,
            Outcome::HttpStatus {
                status: 503,
                detail: "HTTP status 503 Service Unavailable; expected 200".into()
            }
        );
        let got = server.await.unwrap();
        assert_eq!(
            String::from_utf8(got).unwrap(),
            format!(
                "GET /healthz HTTP/1.1\r\nHost: {addr}\r\nUser-Agent: harvester-lb/{}\r\nConnection: close\r\n\r\n",
                env!("CARGO_PKG_VERSION")
            )
        );

        let (addr, server) = one_answer("::1", KUBE_PROXY_503).await;
        let expect = check("/x?y=1", Some("node-1:10256"), &[(200, 299), (500, 503)]);
        let (outcome, _) = probe(&expect, addr, t, &sockets).await;
        assert_eq!(outcome, Outcome::Ok);
        let got = String::from_utf8(server.await.unwrap()).unwrap();
        assert!(
            got.starts_with("GET /x?y=1 HTTP/1.1\r\nHost: node-1:10256\r\n"),
            "{got}"
        );
        assert_eq!(sockets.idle(), 0, "HTTP probes take no kept socket");
    }

    #[tokio::test]
    async fn an_interim_answer_is_skipped_and_the_final_one_judged() {
        let sockets = ProbeSockets::new();
        let t = Duration::from_secs(5);
        // 103 Early Hints in the same segment as the final 503.
        let (addr, server) = one_answer(
            "127.0.0.1",
            b"HTTP/1.1 103 Early Hints\r\nLink: </a.css>\r\n\r\nHTTP/1.1 503 Service Unavailable\r\nContent-Length: 0\r\n\r\n",
        )
        .await;
        let (outcome, _) = probe(&check("/healthz", None, &[(200, 200)]), addr, t, &sockets).await;
        assert_eq!(
            outcome,
            Outcome::HttpStatus {
                status: 503,
                detail: "HTTP status 503 Service Unavailable; expected 200".into()
            }
        );
        server.await.unwrap();
        // 100 Continue alone, then the server closes: no final answer.
        let (addr, server) = one_answer("127.0.0.1", b"HTTP/1.1 100 Continue\r\n\r\n").await;
        let (outcome, _) = probe(&check("/healthz", None, &[(100, 599)]), addr, t, &sockets).await;
        assert_eq!(
            outcome,
            Outcome::HttpError("connection closed before a status line".into())
        );
        server.await.unwrap();
    }

    #[tokio::test]
    async fn the_default_host_of_an_ipv6_backend_is_bracketed() {
        let c = HttpCheck {
            path: "/healthz".into(),
            host: None,
            expect_status: StatusSet::new([(200, 200)]),
            send_proxy: false,
        };
        let req = request_head(&c, "[::1]:10256".parse().unwrap());
        assert!(req.contains("\r\nHost: [::1]:10256\r\n"), "{req}");
    }

    #[tokio::test]
    async fn broken_answers_are_http_errors_that_say_what_came() {
        let sockets = ProbeSockets::new();
        let t = Duration::from_secs(5);
        let cases: [(&'static [u8], &str); 4] = [
            (b"", "connection closed before a status line"),
            (b"hello\r\n\r\n", "malformed response head"),
            (
                b"HTTP/1.1 200 OK\r\n",
                "connection closed before the end of the response head (after 17 bytes: \"HTTP/1.1 200 OK\\r\")",
            ),
            (
                b"HTTP/1.1 2000 OK\r\n\r\n",
                "malformed response head (invalid response status): \"HTTP/1.1 2000 OK\\r\"",
            ),
        ];
        for (answer, says) in cases {
            let (addr, _server) = one_answer("127.0.0.1", answer).await;
            let (outcome, _) = probe(&check("/", None, &[(200, 200)]), addr, t, &sockets).await;
            assert_eq!(outcome.label(), "http_error", "{answer:?}: {outcome:?}");
            let d = outcome.describe().unwrap();
            assert!(d.contains(says), "{answer:?}: {d}");
        }
    }
}
