//! Faults on real test hosts: the real daemon in a network namespace, nodes
//! and clients in others, faults made with nftables, link state and process
//! kills. See `tests/it/netns/mod.rs` for the bed; the tests
//! are in `tests/it/faults/`.
//!
//! Every test skips with a printed reason unless run as root with iproute2
//! and nftables. Run: `cargo test --test it -- faults:: --nocapture`.

// These tests time real processes and sockets, not tokio timers.
#![allow(clippy::disallowed_types, clippy::disallowed_methods)]

// The fault tests, one file a kind of fault, in `tests/it/faults/`.
mod t_detect;
mod t_failover;
mod t_hostile;
mod t_transfer;
mod t_vip;

/// Not a test of its own: the body of the backend *process* that
/// `t_transfer` kills, which runs it as `faults::helper_echo_process` with `--ignored --exact`. Ignored, so a
/// plain `cargo test` does not count it as a test that passed: it asserts nothing.
#[test]
#[ignore = "a backend process for t_transfer, not a test"]
fn helper_echo_process() {
    let Ok(listen) = std::env::var("HLB_HELPER_LISTEN") else {
        return;
    };
    let name = std::env::var("HLB_HELPER_NAME").unwrap_or_default();
    let l = std::net::TcpListener::bind(&listen).expect("helper bind");
    println!("helper listening on {listen}");
    for s in l.incoming() {
        let Ok(mut s) = s else { continue };
        let name = name.clone();
        std::thread::spawn(move || {
            use std::io::{Read, Write};
            let _ = s.write_all(format!("{name}\n").as_bytes());
            let mut buf = [0u8; 16 * 1024];
            loop {
                match s.read(&mut buf) {
                    Ok(0) | Err(_) => break,
                    Ok(n) => {
                        if s.write_all(&buf[..n]).is_err() {
                            break;
                        }
                    }
                }
            }
            let _ = s.shutdown(std::net::Shutdown::Write);
        });
    }
}
