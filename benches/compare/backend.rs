//! The tiny HTTP backend: this bench binary re-run with `--serve-http ADDR`,
//! so the backend is a process of its own, measured apart from the proxies
//! and stopped by pid like them.

use std::net::SocketAddr;
use std::time::Duration;

use crate::util::bench_listener;

const KEEPALIVE_RESPONSE: &[u8] =
    b"HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\nContent-Length: 3\r\n\r\nok\n";
const CLOSE_RESPONSE: &[u8] = b"HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\nContent-Length: 3\r\nConnection: close\r\n\r\nok\n";

/// Answers every request with a 3-byte 200, on one thread; honours
/// `Connection: close`. On `0.0.0.0` it serves every loopback address (the
/// scale scenario's 30,000 backends, see [`bench_listener`]). Never returns.
pub fn serve_http(addr: SocketAddr) -> ! {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("runtime");
    rt.block_on(async move {
        let listener =
            tokio::net::TcpListener::from_std(bench_listener(addr)).expect("tokio listener");
        loop {
            if let Ok((s, _)) = listener.accept().await {
                tokio::spawn(http_conn(s));
            } else {
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
        }
    })
}

async fn http_conn(mut s: tokio::net::TcpStream) {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let _ = s.set_nodelay(true);
    let mut buf = vec![0u8; 4096];
    let mut filled = 0;
    let mut out = Vec::with_capacity(256);
    loop {
        let n = match s.read(&mut buf[filled..]).await {
            Ok(0) | Err(_) => return,
            Ok(n) => n,
        };
        filled += n;
        let mut start = 0;
        let mut close = false;
        out.clear();
        while let Some(end) = find(&buf[start..filled], b"\r\n\r\n") {
            let head = &buf[start..start + end];
            start += end + 4;
            if contains_ignore_case(head, b"connection: close") {
                out.extend_from_slice(CLOSE_RESPONSE);
                close = true;
                break;
            }
            out.extend_from_slice(KEEPALIVE_RESPONSE);
        }
        buf.copy_within(start..filled, 0);
        filled -= start;
        if !out.is_empty() && s.write_all(&out).await.is_err() {
            return;
        }
        if close || filled == buf.len() {
            return;
        }
    }
}

fn find(hay: &[u8], needle: &[u8]) -> Option<usize> {
    hay.windows(needle.len()).position(|w| w == needle)
}

fn contains_ignore_case(hay: &[u8], needle: &[u8]) -> bool {
    hay.windows(needle.len())
        .any(|w| w.eq_ignore_ascii_case(needle))
}
