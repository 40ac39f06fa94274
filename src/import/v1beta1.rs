//! `LoadBalancer` `loadbalancer.harvesterhci.io/v1beta1`, Harvester's
//! current model: `spec.listeners[]`, `spec.healthCheck`, `spec.ipam`,
//! `status.allocatedAddress.ip` (the VIP; `0.0.0.0` for DHCP, when
//! `status.address` holds the leased one) and `status.backendServers` (the
//! nodes the controller selected).

use super::common::Layout;

/// The API version this module reads.
pub const API_VERSION: &str = "loadbalancer.harvesterhci.io/v1beta1";

/// Where v1beta1 keeps each thing.
pub const LAYOUT: Layout = Layout {
    vip: &["status", "allocatedAddress", "ip"],
    vip_fallback: &["status", "address"],
    backends: &["status", "backendServers"],
    period: &["periodSeconds"],
};
