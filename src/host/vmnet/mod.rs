//! VIPs on VM networks: keepalived's file and its management check
//! ([`keepalived`], [`mgmt_check`], and the hand-off of both daemons' files
//! to root, [`handoff`]), the networks' tables and rules ([`network`]),
//! whether a network can be on an interface here ([`network_link`]), the
//! bridged networks' legs ([`leg`], [`mgmt_leg`]), the marks that route a
//! kernel listener's replies back through its network ([`replymark`]), and
//! the guard that keeps a host from routing for the VMs ([`vmnet_filter`]).
//! Driven by `daemon::vmnet`.

pub mod handoff;
pub mod keepalived;
pub mod leg;
pub mod mgmt_check;
pub mod mgmt_leg;
pub mod network;
pub mod network_link;
pub mod network_refusals;
pub mod replymark;
pub mod vmnet_filter;
