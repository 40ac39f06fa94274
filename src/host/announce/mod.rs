//! `vip.announce = "routes"`, top to bottom: the component that decides
//! per VIP whether this host attracts its traffic and runs the task that
//! writes it ([`announcer`]), the per-VIP hysteresis it decides with
//! ([`decide`]), and the routes that announce a VIP to a BGP speaker and
//! the VIPs' AnyIP local routes ([`routes`]), both owned through
//! [`crate::host::owned::Driver`]. What it reads of the daemon is the
//! `AnnounceView` the daemon implements (`daemon/announce.rs`).

pub mod announcer;
pub mod decide;
pub mod routes;
