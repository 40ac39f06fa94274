//! The VIPs themselves, beyond listening on them: who may reach what on a
//! VIP ([`isolate`]).
//!
//! Listeners bind with `IP_FREEBIND`, so the daemon never needs the VIP to
//! be up, and whichever host holds it (keepalived, kube-vip) the daemon is
//! the same: listeners bound, probes running, healthy sets current.

pub mod isolate;
