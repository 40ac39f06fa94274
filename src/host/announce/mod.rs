//! `vip.announce = "routes"`: the routes that announce a VIP to a BGP
//! speaker and the VIPs' AnyIP local routes ([`routes`]), both owned
//! through [`crate::host::owned::Driver`]. Which VIPs this host announces
//! and when is decided by `daemon::announce`.

pub mod routes;
