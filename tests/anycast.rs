//! Anycast VIPs over BGP: two load-balancer hosts announce the same VIP
//! through real BIRD 2 to a router that spreads flows by ECMP (see
//! `tests/netns/bgp.rs` for the bed and `docs/many-hosts.md` for the
//! figures). Run as root; under CI a missing tool fails the test.

#![allow(clippy::disallowed_types, clippy::disallowed_methods)]

#[path = "netns/mod.rs"]
mod netns;

use std::net::{IpAddr, SocketAddr};
use std::time::Duration;

use netns::bgp::{BgpBed, PORT, VIP};

fn vip() -> SocketAddr {
    SocketAddr::new(IpAddr::V4(VIP), PORT)
}

/// The bed itself, with the routes written by hand as the daemon would:
/// the router holds one route with both hosts as nexthops and spreads
/// connections over both.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bgp_bed_by_hand_spreads_over_both_hosts() {
    require_bgp!();
    let mut bed = BgpBed::new("hand", true).await;
    for i in 1..=2 {
        let h = bed.host_mut(i);
        h.write_config("");
        h.start_daemon().await;
        h.announce_by_hand(true);
    }
    bed.wait_nexthops(&[1, 2], Duration::from_secs(10)).await;
    let counts = bed.spread(vip(), 100).await;
    eprintln!("spread of 100 connections: {counts:?}");
    assert_eq!(counts.get(&0), None, "failed connections: {counts:?}");
    assert!(counts.get(&1).copied().unwrap_or(0) >= 10, "{counts:?}");
    assert!(counts.get(&2).copied().unwrap_or(0) >= 10, "{counts:?}");
    bed.host(1).announce_by_hand(false);
    bed.wait_nexthops(&[2], Duration::from_secs(5)).await;
    let counts = bed.spread(vip(), 20).await;
    assert_eq!(counts.get(&2), Some(&20), "{counts:?}");
}
