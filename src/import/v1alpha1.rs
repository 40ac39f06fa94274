//! `LoadBalancer` `loadbalancer.harvesterhci.io/v1alpha1`, the deprecated
//! model of the v0.1.x cloud provider: the backends are in
//! `spec.backendServers`, the VIP in `status.address`, and the health
//! check keeps its historic field names (`PeriodSeconds` with a capital P;
//! `periodSeconds` is read too, for objects a newer server converted).

use super::common::Layout;

/// The API version this module reads.
pub const API_VERSION: &str = "loadbalancer.harvesterhci.io/v1alpha1";

/// Where v1alpha1 keeps each thing.
pub const LAYOUT: Layout = Layout {
    vip: &["status", "address"],
    vip_fallback: &["status", "allocatedAddress", "ip"],
    backends: &["spec", "backendServers"],
    period: &["PeriodSeconds", "periodSeconds"],
};
