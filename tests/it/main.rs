//! The integration tests: one crate, one binary, a module per area (the
//! file of the same name; a folder beside it holds its parts). `support`
//! (loopback subnets, backends, the daemon in-process) and `netns` (the
//! network-namespace beds) are compiled once for all of them, and the
//! library is linked once.
//!
//! A test's name is its module path: `cargo test --test it -- dhcp::` runs
//! one area's tests, `cargo test --test it -- --exact dhcp::a_leased_vip_is_isolated_once_it_is_leased` one
//! test. CI runs the namespace beds' modules and the rest in two lanes
//! (`.ci/run`).

mod netns;
mod support;

mod admin_cli;
mod admin_state;
mod affinity;
mod announce;
mod anycast;
mod anycast_hosts;
mod bad_input;
mod config_check;
mod config_reuse;
mod connection_log;
mod conntrack_hosts;
mod conntrack_sync;
mod conntrack_sync_v6;
mod dhcp;
mod docs;
mod faults;
mod forwarding;
mod hand_over_host;
mod http_check;
mod import;
mod kernel_config;
mod kernel_forwarding;
mod kernel_scale;
mod listener_options;
mod messages;
mod mgmt_vips;
mod one_verdict;
mod per_listener_health;
mod prometheus;
mod proxy_protocol;
mod readiness;
mod reload;
mod restart;
mod source_ranges;
mod state_file;
mod status_cli;
mod tenants;
mod threads;
mod udp;
mod vmnet;
mod vmnet_bridged;
mod vmnet_claims;
mod vmnet_hosts;
mod vmnet_instances;
mod vmnet_isolation;
mod vmnet_replies;
mod vmnet_split;
