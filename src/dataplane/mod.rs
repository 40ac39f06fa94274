//! The data plane: what a connection or a datagram meets between the
//! client and a backend, and nothing that writes into the host.
//!
//! * [`balancer`]: the healthy set swapped atomically, and the picking algorithms.
//! * [`health`]: probes and the per-backend state machine.
//! * [`proxy`]: listeners, accept, connect with retry, zero-copy forwarding.
//! * [`workers`]: the threads TCP connections run on (thread per core or work stealing).
//! * [`budget`]: one bound shared by many tables (affinity entries, UDP flows).
//!
//! `proxy` and `health` never import each other: the forwarder sees health
//! only through the balancer's snapshot.

pub mod balancer;
pub mod budget;
pub mod health;
pub mod proxy;
pub mod workers;
