//! The VIPs themselves, beyond listening on them: who may reach what on a
//! VIP ([`port_filter`]), the lease of a VIP the daemon obtains itself over
//! DHCP ([`dhcp`]), and the routes that announce a VIP to a BGP speaker
//! ([`announce`]), and the guard that keeps the host's own addresses and
//! its gateways from becoming VIPs ([`host`]), and the guard that keeps a
//! host on VM networks from routing for their VMs ([`vmnet_filter`]), and
//! the marks that route a kernel listener's replies back through its VIP's
//! VM network ([`replymark`]), and whether a VM network can be on a
//! `[[network]]`'s interface here ([`network_link`]).
//!
//! Listeners bind with `IP_FREEBIND`, so the daemon never needs the VIP to
//! be up, and whichever host holds it (keepalived, kube-vip) the daemon is
//! the same: listeners bound, probes running, healthy sets current. The
//! daemon drives this module; nothing here touches forwarding, and nothing
//! here calls up into the daemon (a lease change is announced on a `Notify`).

pub mod announce;
pub mod conntrackd;
pub mod dhcp;
pub mod gate;
pub mod handoff;
pub mod host;
pub mod keepalived;
pub mod leg;
pub mod mgmt_check;
pub mod mgmt_leg;
pub mod network;
pub mod network_link;
pub mod port_filter;
pub mod replymark;
pub mod vmnet_filter;

/// Runs an operator's configured command (`keepalived.reload_command`,
/// `conntrackd.restart_command`) with no stdin and waits for it; `Err` is
/// why it failed, written for the operator (it could not start, or its
/// exit status with what it printed), for the caller's own error type.
pub(crate) fn run_configured(command: &[String]) -> Result<(), String> {
    let Some((program, args)) = command.split_first() else {
        return Err("the command is empty".to_string());
    };
    let out = std::process::Command::new(program)
        .args(args)
        .stdin(std::process::Stdio::null())
        .output()
        .map_err(|e| e.to_string())?;
    if out.status.success() {
        return Ok(());
    }
    Err(format!(
        "{}: {}{}",
        out.status,
        String::from_utf8_lossy(&out.stdout).trim(),
        String::from_utf8_lossy(&out.stderr).trim()
    ))
}
