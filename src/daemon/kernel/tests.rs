use super::blocked::{
    bridge_stage_of, forwarding_of, own_bridge_stage_of, pack_bridge_stage, pack_forwarding,
};
use super::*;
use crate::os::Sysctl;

/// The bridge-stage bits (the sysctl's and the bridges' own switches,
/// per family) and the forwarding bits do not overlap: a bridge's own
/// switch alone is seen as such, and a change of it changes the byte
/// (which rebuilds the kernel listeners).
#[test]
fn bridge_stage_bits_are_their_own() {
    let forwarding = pack_forwarding([Sysctl::On, Sysctl::Off]);
    let p = pack_bridge_stage(forwarding, [false, true], [true, false]);
    assert!(!bridge_stage_of(p, 0) && bridge_stage_of(p, 1));
    assert!(own_bridge_stage_of(p, 0) && !own_bridge_stage_of(p, 1));
    assert_eq!(forwarding_of(p, 0), Sysctl::On);
    assert_eq!(forwarding_of(p, 1), Sysctl::Off);
    assert_ne!(
        pack_bridge_stage(forwarding, [false; 2], [false; 2]),
        pack_bridge_stage(forwarding, [false; 2], [true, false]),
    );
}

fn listener(eligible: &[[u8; 4]], close_down: &[[u8; 4]]) -> KernelListener {
    let ips = |v: &[[u8; 4]]| v.iter().map(|&a| IpAddr::from(a)).collect::<Vec<_>>();
    KernelListener {
        close_down: ips(close_down),
        ..KernelListener::round_robin(30080, ips(&[[10, 0, 0, 1], [10, 0, 0, 2]]), ips(eligible))
    }
}

fn one(protocol: Protocol, l: KernelListener) -> Desired {
    let mut d = Desired::new();
    d.insert((IpAddr::from([192, 0, 2, 10]), protocol, 53), l);
    d
}

#[test]
fn only_a_backend_leaving_a_udp_listener_or_newly_closed_needs_a_sweep() {
    let both = [[10, 0, 0, 1], [10, 0, 0, 2]];
    let first = [[10, 0, 0, 1]];
    let udp = |e: &[[u8; 4]]| one(Protocol::Udp, listener(e, &[]));
    let tcp = |e: &[[u8; 4]], c: &[[u8; 4]]| one(Protocol::Tcp, listener(e, c));
    assert!(flows_may_be_stale(&udp(&first), &udp(&both)));
    assert!(flows_may_be_stale(&udp(&[]), &udp(&first)));
    assert!(!flows_may_be_stale(&udp(&both), &udp(&first)), "one back");
    assert!(
        !flows_may_be_stale(&tcp(&first, &[]), &tcp(&both, &[])),
        "a TCP drain"
    );
    let down = [[10, 0, 0, 2]];
    assert!(flows_may_be_stale(&tcp(&first, &down), &tcp(&both, &[])));
    assert!(!flows_may_be_stale(
        &tcp(&first, &down),
        &tcp(&first, &down)
    ));
    assert!(
        flows_may_be_stale(&udp(&both), &Desired::new()),
        "a new UDP listener"
    );
    assert!(!flows_may_be_stale(&tcp(&both, &[]), &Desired::new()));
}

#[test]
fn forwarding_packs_each_family_and_unreadable_is_not_on() {
    use Sysctl::*;
    for v4 in [On, Off, Unreadable] {
        for v6 in [On, Off, Unreadable] {
            let packed = pack_forwarding([v4, v6]);
            assert_eq!(forwarding_of(packed, 0), v4);
            assert_eq!(forwarding_of(packed, 1), v6);
            assert_eq!(packed == 0, v4 == On && v6 == On, "{v4:?} {v6:?}");
        }
    }
}
