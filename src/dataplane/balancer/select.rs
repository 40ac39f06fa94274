//! Picking algorithms: where a new connection goes among the eligible backends.
//!
//! A pick is pure arithmetic over the snapshot the forwarder already holds: no
//! lock, no allocation. Each algorithm only chooses the *first* candidate;
//! connect retries then walk the eligible list round from it, so every
//! algorithm gets the same bounded, duplicate-free retry order.

use std::net::IpAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use super::{Backend, ClientAddr};
use crate::config::Algorithm;

/// Index of the first candidate in `eligible` (which must not be empty).
pub fn first_candidate(
    algorithm: Algorithm,
    eligible: &[Arc<Backend>],
    client: ClientAddr,
    cursor: &AtomicUsize,
) -> usize {
    debug_assert!(!eligible.is_empty());
    match algorithm {
        Algorithm::RoundRobin => cursor.fetch_add(1, Ordering::Relaxed) % eligible.len(),
        Algorithm::LeastConnections => least_connections(eligible, cursor),
        Algorithm::SourceIp => highest_random_weight(eligible, client),
        Algorithm::FlowHash => flow_hash(eligible, client),
    }
}

/// The backend with the fewest open connections. Ties are broken round robin
/// (the scan starts at a rotating offset), so a quiet load balancer whose
/// connections are short does not send everything to the first backend.
fn least_connections(eligible: &[Arc<Backend>], cursor: &AtomicUsize) -> usize {
    let n = eligible.len();
    let start = cursor.fetch_add(1, Ordering::Relaxed) % n;
    let mut best = start;
    let mut best_load = eligible[start].active_connections();
    for step in 1..n {
        let i = (start + step) % n;
        let load = eligible[i].active_connections();
        if load < best_load {
            best = i;
            best_load = load;
        }
    }
    best
}

/// Rendezvous (highest random weight) hashing of the client IP. A client
/// keeps its backend as long as that backend is eligible; when one leaves,
/// only its own clients move, and they spread over the others. The hash is a
/// fixed function, so the mapping is the same after a restart and on every
/// host running the same config.
fn highest_random_weight(eligible: &[Arc<Backend>], client: ClientAddr) -> usize {
    rendezvous(client.ip(), eligible.iter().map(|b| b.addr_hash))
}

/// Rendezvous hashing of the client's address and port: the proxy's form
/// of the kernel's `flow_hash` (a listener falls back to it when the
/// kernel refuses a write). Deterministic and per connection, like the
/// kernel's, so connections spread as with round robin and each host with
/// the same config picks alike; the proxy ends each TCP connection itself,
/// so a flow never moves between it and the kernel mid-stream, and which
/// hash of the flow it uses need not be the kernel's `jhash`.
fn flow_hash(eligible: &[Arc<Backend>], client: ClientAddr) -> usize {
    let key = mix64(hash_ip(client.ip()) ^ u64::from(client.socket().port()));
    rendezvous_key(key, eligible.iter().map(|b| b.addr_hash))
}

/// The rendezvous pick itself: the index, among backends given by the
/// hashes of their addresses ([`hash_ip`]), that `client` goes to (0 when
/// there is none). Shared by the proxy and by the kernel's `source_ip`
/// buckets, which must pick alike so a client keeps its backend whichever
/// path serves it.
pub fn rendezvous(client: IpAddr, backend_hashes: impl IntoIterator<Item = u64>) -> usize {
    rendezvous_key(hash_ip(client), backend_hashes)
}

/// [`rendezvous`] for a key already hashed: the backend (index) whose
/// score for `key` is highest.
fn rendezvous_key(client: u64, backend_hashes: impl IntoIterator<Item = u64>) -> usize {
    let mut best = 0;
    let mut best_score = 0;
    for (i, addr_hash) in backend_hashes.into_iter().enumerate() {
        let score = mix64(client ^ addr_hash);
        if i == 0 || score > best_score {
            best = i;
            best_score = score;
        }
    }
    best
}

/// A stable 64-bit hash of an IP address (FNV-1a over its octets, then mixed).
pub fn hash_ip(ip: IpAddr) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    let mut eat = |bytes: &[u8]| {
        for b in bytes {
            h ^= u64::from(*b);
            h = h.wrapping_mul(0x0100_0000_01b3);
        }
    };
    match ip {
        IpAddr::V4(v4) => eat(&v4.octets()),
        IpAddr::V6(v6) => eat(&v6.octets()),
    }
    mix64(h)
}

/// SplitMix64's finaliser: spreads every input bit over the output.
pub fn mix64(mut z: u64) -> u64 {
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    fn client_at(ip: [u8; 4]) -> ClientAddr {
        ClientAddr::new(std::net::SocketAddr::from((ip, 40000)))
    }

    fn backends(n: u8) -> Vec<Arc<Backend>> {
        (1..=n)
            .map(|i| Backend::new(IpAddr::from([10, 0, 0, i]), true))
            .collect()
    }

    #[test]
    fn round_robin_visits_each_backend_in_turn() {
        let b = backends(3);
        let cursor = AtomicUsize::new(0);
        let client = client_at([192, 0, 2, 1]);
        let picks: Vec<usize> = (0..6)
            .map(|_| first_candidate(Algorithm::RoundRobin, &b, client, &cursor))
            .collect();
        assert_eq!(picks, vec![0, 1, 2, 0, 1, 2]);
    }

    #[test]
    fn least_connections_prefers_the_idlest_backend() {
        let b = backends(3);
        let _g0 = b[0].connection_opened();
        let _g0b = b[0].connection_opened();
        let _g2 = b[2].connection_opened();
        let cursor = AtomicUsize::new(0);
        for _ in 0..5 {
            let pick = first_candidate(
                Algorithm::LeastConnections,
                &b,
                client_at([192, 0, 2, 1]),
                &cursor,
            );
            assert_eq!(pick, 1);
        }
    }

    #[test]
    fn least_connections_breaks_ties_round_robin() {
        let b = backends(3);
        let cursor = AtomicUsize::new(0);
        let client = client_at([192, 0, 2, 1]);
        let mut seen = [0; 3];
        for _ in 0..30 {
            seen[first_candidate(Algorithm::LeastConnections, &b, client, &cursor)] += 1;
        }
        assert_eq!(seen, [10, 10, 10]);
    }

    #[test]
    fn flow_hash_spreads_one_clients_flows_and_moves_only_those_of_a_removed_backend() {
        let all = backends(4);
        let cursor = AtomicUsize::new(0);
        // One client address, 2000 source ports.
        let flows: Vec<ClientAddr> = (0..2000u16)
            .map(|p| ClientAddr::new(std::net::SocketAddr::from(([192, 0, 2, 1], 30000 + p))))
            .collect();
        let pick = |set: &[Arc<Backend>], c: ClientAddr| {
            set[first_candidate(Algorithm::FlowHash, set, c, &cursor)].addr
        };
        let before: Vec<IpAddr> = flows.iter().map(|c| pick(&all, *c)).collect();
        let mut counts: HashMap<IpAddr, usize> = HashMap::new();
        for b in &before {
            *counts.entry(*b).or_default() += 1;
        }
        assert_eq!(counts.len(), 4, "one client's flows spread: {counts:?}");
        assert!(
            counts.values().all(|&n| (375..=625).contains(&n)),
            "{counts:?}"
        );
        // Deterministic: another set of the same backends (another host)
        // picks alike, whatever the order.
        let mut other = backends(4);
        other.reverse();
        for (c, b) in flows.iter().zip(&before) {
            assert_eq!(pick(&other, *c), *b);
        }
        let removed = all[1].addr;
        let rest: Vec<Arc<Backend>> = all.iter().filter(|b| b.addr != removed).cloned().collect();
        for (c, b) in flows.iter().zip(&before) {
            if *b != removed {
                assert_eq!(
                    pick(&rest, *c),
                    *b,
                    "flow {c:?} moved although its backend stayed"
                );
            }
        }
    }

    #[test]
    fn source_ip_is_sticky_and_only_moves_clients_of_a_removed_backend() {
        let all = backends(4);
        let cursor = AtomicUsize::new(0);
        let clients: Vec<ClientAddr> = (0..2000u32)
            .map(|i| client_at((0xc633_6400u32 + i).to_be_bytes()))
            .collect();
        let before: Vec<IpAddr> = clients
            .iter()
            .map(|c| all[first_candidate(Algorithm::SourceIp, &all, *c, &cursor)].addr)
            .collect();
        // Sticky: the same answer twice.
        for (c, b) in clients.iter().zip(&before) {
            assert_eq!(
                all[first_candidate(Algorithm::SourceIp, &all, *c, &cursor)].addr,
                *b
            );
        }
        // Spread: every backend gets a fair share (2000/4 = 500, allow +-25%).
        let mut counts: HashMap<IpAddr, usize> = HashMap::new();
        for b in &before {
            *counts.entry(*b).or_default() += 1;
        }
        assert_eq!(counts.len(), 4);
        assert!(
            counts.values().all(|&n| (375..=625).contains(&n)),
            "{counts:?}"
        );
        // Minimal disruption: drop backend 2; only its clients move.
        let removed = all[2].addr;
        let rest: Vec<Arc<Backend>> = all.iter().filter(|b| b.addr != removed).cloned().collect();
        for (c, b) in clients.iter().zip(&before) {
            let now = rest[first_candidate(Algorithm::SourceIp, &rest, *c, &cursor)].addr;
            if *b != removed {
                assert_eq!(now, *b, "client {c:?} moved although its backend stayed");
            }
        }
    }
}
