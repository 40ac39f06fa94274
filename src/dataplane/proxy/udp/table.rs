//! The bounds on UDP flows: one budget for the whole process
//! (`proxy.max_udp_flows`, every flow holds a socket), one per load
//! balancer (its share, `max_udp_flows` of `[[load_balancer]]`) and, per
//! listener, a table from client address to flow that also counts flows
//! per source (`proxy.max_udp_flows_per_source`): an IPv4 address, or an
//! IPv6 /64, since one host is given a whole /64 and can send from any
//! address of it.
//!
//! A table never grows past its bounds: a flow that does not fit is refused
//! (its datagram dropped and counted), never queued. The table's lock is
//! held for a map operation only, never across I/O.

use std::collections::HashMap;
use std::collections::hash_map::Entry;
use std::hash::Hash;
use std::net::{IpAddr, Ipv6Addr, SocketAddr};
use std::sync::{Arc, Mutex};

/// The process-wide bound on UDP flows (`proxy.max_udp_flows`, every flow
/// holds a socket), shared by every UDP listener.
pub type FlowBudget = crate::dataplane::budget::Budget;

/// The default `proxy.max_udp_flows` for an open-file limit: a third of
/// what is left after the daemon's own reserve, as for TCP connections (a
/// flow holds one socket, a TCP connection two: together they stay within
/// the limit).
pub fn default_max_flows(open_files: u64) -> usize {
    crate::os::connections_for(open_files)
}

/// Why a new flow was not admitted.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Refusal {
    /// `proxy.max_udp_flows` flows are open.
    TableFull,
    /// This client's source (IPv4 address, IPv6 /64) has
    /// `proxy.max_udp_flows_per_source` flows on this listener.
    SourceLimit,
    /// The load balancer holds its share of `proxy.max_udp_flows`.
    LoadBalancerLimit,
}

/// The source a client is counted as for the per-source bound: its IPv4
/// address (IPv4-mapped IPv6 included), or its IPv6 /64.
pub fn source_key(ip: IpAddr) -> IpAddr {
    match ip.to_canonical() {
        IpAddr::V6(v6) => IpAddr::V6(Ipv6Addr::from(u128::from(v6) & !((1u128 << 64) - 1))),
        v4 => v4,
    }
}

/// One listener's flows by client address, and their count per client IP.
/// Generic over the flow type so the bounds are tested without sockets.
pub struct FlowTable<F> {
    inner: Mutex<Inner<F>>,
    budget: Arc<FlowBudget>,
}

struct Inner<F> {
    /// Each flow and the load balancer budget it holds a slot of (the
    /// listener may serve another load balancer after a reload).
    flows: HashMap<SocketAddr, (Arc<F>, Arc<FlowBudget>)>,
    per_source: HashMap<IpAddr, usize>,
}

impl<F> FlowTable<F> {
    /// An empty table drawing on `budget`.
    pub fn new(budget: Arc<FlowBudget>) -> Self {
        Self {
            inner: Mutex::new(Inner {
                flows: HashMap::new(),
                per_source: HashMap::new(),
            }),
            budget,
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Inner<F>> {
        // Every write below is complete before anything can panic.
        self.inner.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The flow of `client`, if one is open.
    pub fn get(&self, client: &SocketAddr) -> Option<Arc<F>> {
        self.lock().flows.get(client).map(|(f, _)| Arc::clone(f))
    }

    /// Flows open now.
    pub fn len(&self) -> usize {
        self.lock().flows.len()
    }

    /// Whether no flow is open.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Admits a new flow of `client` made by `make` if it fits every bound
    /// (its source's, its load balancer's `lb`, the process's) and `client`
    /// has none. `make` runs under the lock: it must not block (it makes a
    /// socket, nothing more).
    pub fn insert(
        &self,
        client: SocketAddr,
        per_source_max: usize,
        lb: &Arc<FlowBudget>,
        make: impl FnOnce() -> Option<Arc<F>>,
    ) -> Result<Option<Arc<F>>, Refusal> {
        let mut inner = self.lock();
        let source = source_key(client.ip());
        let count = inner.per_source.get(&source).copied().unwrap_or(0);
        if count >= per_source_max {
            return Err(Refusal::SourceLimit);
        }
        // The process's bound first: a full table is said as such even
        // when the load balancer's share is the whole table (one load
        // balancer).
        if !self.budget.take() {
            return Err(Refusal::TableFull);
        }
        if !lb.take() {
            self.budget.give_back(1);
            return Err(Refusal::LoadBalancerLimit);
        }
        let give_back = || {
            self.budget.give_back(1);
            lb.give_back(1);
        };
        let Some(flow) = make() else {
            give_back();
            return Ok(None);
        };
        match inner.flows.entry(client) {
            Entry::Occupied(_) => {
                // The caller removes the old flow first; keep the old one.
                give_back();
                return Ok(None);
            }
            Entry::Vacant(v) => {
                v.insert((Arc::clone(&flow), Arc::clone(lb)));
            }
        }
        *inner.per_source.entry(source).or_insert(0) += 1;
        Ok(Some(flow))
    }

    /// Removes `client`'s entry if it is `flow`, giving its slots back.
    /// Returns whether it was removed (so exactly one caller accounts for it).
    pub fn remove(&self, client: &SocketAddr, flow: &Arc<F>) -> bool {
        let mut inner = self.lock();
        let Some((current, _)) = inner.flows.get(client) else {
            return false;
        };
        if !Arc::ptr_eq(current, flow) {
            return false;
        }
        let Some((_, lb)) = inner.flows.remove(client) else {
            return false;
        };
        decrement(&mut inner.per_source, source_key(client.ip()));
        self.budget.give_back(1);
        lb.give_back(1);
        true
    }

    /// Every flow open now (to end them all when the listener stops).
    pub fn all(&self) -> Vec<Arc<F>> {
        self.lock()
            .flows
            .values()
            .map(|(f, _)| Arc::clone(f))
            .collect()
    }
}

fn decrement<K: Hash + Eq>(map: &mut HashMap<K, usize>, key: K) {
    if let Entry::Occupied(mut e) = map.entry(key) {
        if *e.get() <= 1 {
            e.remove();
        } else {
            *e.get_mut() -= 1;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn lb() -> Arc<FlowBudget> {
        FlowBudget::new(usize::MAX)
    }

    fn addr(ip: [u8; 4], port: u16) -> SocketAddr {
        SocketAddr::from((ip, port))
    }

    #[test]
    fn the_budget_and_the_per_source_cap_bound_the_table() {
        let budget = FlowBudget::new(5);
        let a: FlowTable<u32> = FlowTable::new(Arc::clone(&budget));
        let b: FlowTable<u32> = FlowTable::new(Arc::clone(&budget));
        // One source floods ports: it gets its share (2), no more.
        for port in 1..=2 {
            assert!(matches!(
                a.insert(addr([10, 0, 0, 1], port), 2, &lb(), || Some(Arc::new(0))),
                Ok(Some(_))
            ));
        }
        assert_eq!(
            a.insert(addr([10, 0, 0, 1], 3), 2, &lb(), || Some(Arc::new(0)))
                .err(),
            Some(Refusal::SourceLimit)
        );
        // Other sources, on another listener too, fill the process budget.
        for i in 2..=4 {
            assert!(
                b.insert(addr([10, 0, 0, i], 1), 2, &lb(), || Some(Arc::new(0)))
                    .is_ok()
            );
        }
        assert_eq!(budget.used(), 5);
        assert_eq!(
            b.insert(addr([10, 0, 0, 9], 1), 2, &lb(), || Some(Arc::new(0)))
                .err(),
            Some(Refusal::TableFull)
        );
        // A flow that ends frees its slot and its source's share.
        let f = a.get(&addr([10, 0, 0, 1], 1)).expect("open");
        assert!(a.remove(&addr([10, 0, 0, 1], 1), &f));
        assert!(!a.remove(&addr([10, 0, 0, 1], 1), &f), "exactly once");
        assert_eq!(budget.used(), 4);
        assert!(
            a.insert(addr([10, 0, 0, 1], 7), 2, &lb(), || Some(Arc::new(0)))
                .is_ok()
        );
        // A socket that cannot be made takes no slot.
        assert!(matches!(
            b.insert(addr([10, 0, 0, 8], 1), 2, &lb(), || None),
            Err(Refusal::TableFull)
        ));
        budget.set_max(10);
        assert!(matches!(
            b.insert(addr([10, 0, 0, 8], 1), 2, &lb(), || None),
            Ok(None)
        ));
        assert_eq!(budget.used(), 5);
    }

    #[test]
    fn ipv4_mapped_clients_share_their_ipv4_share() {
        let table: FlowTable<u32> = FlowTable::new(FlowBudget::new(100));
        let v4: SocketAddr = "10.0.0.1:1".parse().unwrap();
        let mapped: SocketAddr = "[::ffff:10.0.0.1]:2".parse().unwrap();
        assert!(table.insert(v4, 1, &lb(), || Some(Arc::new(0))).is_ok());
        assert_eq!(
            table.insert(mapped, 1, &lb(), || Some(Arc::new(0))).err(),
            Some(Refusal::SourceLimit)
        );
    }

    #[test]
    fn ipv6_sources_are_counted_per_64() {
        let table: FlowTable<u32> = FlowTable::new(FlowBudget::new(100));
        let one = || Some(Arc::new(0));
        // Eight addresses of one /64: one source, so its bound of 2 holds.
        let admitted = (1..=8)
            .filter(|i| {
                let client: SocketAddr = format!("[2001:db8:1:2::{i}]:53").parse().unwrap();
                matches!(table.insert(client, 2, &lb(), one), Ok(Some(_)))
            })
            .count();
        assert_eq!(admitted, 2);
        // Another /64 is another source.
        let other: SocketAddr = "[2001:db8:1:3::1]:53".parse().unwrap();
        assert!(matches!(table.insert(other, 2, &lb(), one), Ok(Some(_))));
        assert_eq!(
            source_key("2001:db8:1:2:aaaa:bbbb:cccc:dddd".parse().unwrap()),
            "2001:db8:1:2::".parse::<IpAddr>().unwrap()
        );
        assert_eq!(
            source_key("::ffff:10.0.0.1".parse().unwrap()),
            "10.0.0.1".parse::<IpAddr>().unwrap()
        );
        // A flow that ends gives its /64 its share back.
        let first: SocketAddr = "[2001:db8:1:2::1]:53".parse().unwrap();
        let f = table.get(&first).expect("open");
        assert!(table.remove(&first, &f));
        let ninth: SocketAddr = "[2001:db8:1:2::9]:53".parse().unwrap();
        assert!(matches!(table.insert(ninth, 2, &lb(), one), Ok(Some(_))));
    }

    #[test]
    fn a_load_balancer_takes_no_more_than_its_share() {
        let global = FlowBudget::new(10);
        let a_lb = FlowBudget::new(3);
        let b_lb = FlowBudget::new(10);
        let a: FlowTable<u32> = FlowTable::new(Arc::clone(&global));
        let b: FlowTable<u32> = FlowTable::new(Arc::clone(&global));
        for i in 1..=3 {
            assert!(
                a.insert(addr([10, 0, 0, i], 1), 9, &a_lb, || Some(Arc::new(0)))
                    .is_ok()
            );
        }
        assert_eq!(
            a.insert(addr([10, 0, 0, 4], 1), 9, &a_lb, || Some(Arc::new(0)))
                .err(),
            Some(Refusal::LoadBalancerLimit)
        );
        assert_eq!(global.used(), 3, "a refused flow takes no process slot");
        // The other load balancer fills what is left of the process's.
        for i in 1..=7 {
            assert!(
                b.insert(addr([10, 0, 1, i], 1), 9, &b_lb, || Some(Arc::new(0)))
                    .is_ok()
            );
        }
        assert_eq!(
            b.insert(addr([10, 0, 1, 8], 1), 9, &b_lb, || Some(Arc::new(0)))
                .err(),
            Some(Refusal::TableFull)
        );
        assert_eq!(
            b_lb.used(),
            7,
            "a flow refused by the process takes no share"
        );
        let f = a.get(&addr([10, 0, 0, 1], 1)).expect("open");
        assert!(a.remove(&addr([10, 0, 0, 1], 1), &f));
        assert_eq!((a_lb.used(), global.used()), (2, 9));
    }

    #[test]
    fn the_default_bound_follows_the_open_file_limit() {
        assert_eq!(default_max_flows(20_000), 6410);
        assert_eq!(default_max_flows(100), 16);
    }
}
