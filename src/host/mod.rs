//! What the daemon writes into the host, one folder (or file) per feature:
//! the NAT of `forwarding = "kernel"` listeners ([`nat`]), the routes that
//! announce a VIP to a BGP speaker ([`announce`]), the lease of a VIP the
//! daemon obtains itself over DHCP ([`dhcp`]), who may reach what on a VIP
//! ([`isolation`]), VIPs on VM networks ([`vmnet`]: keepalived, the
//! networks' tables, legs and reply marks, the tenant guard), conntrackd's
//! connection sync ([`conntrack_sync`]), and the guard that keeps the
//! host's own addresses and its gateways from becoming VIPs
//! ([`vip_guard`]). Every object written here is owned ([`owned`]); every
//! `nft` command the daemon runs is run in one place ([`nft`]).
//!
//! Listeners bind with `IP_FREEBIND`, so the daemon never needs the VIP to
//! be up, and whichever host holds it (keepalived, kube-vip) the daemon is
//! the same: listeners bound, probes running, healthy sets current. The
//! daemon drives this module; nothing here touches forwarding, and nothing
//! here calls up into the daemon (a lease change is announced on a `Notify`).

pub mod announce;
pub mod conntrack_sync;
pub mod dhcp;
pub mod isolation;
pub mod nat;
pub mod nft;
pub mod owned;
pub mod vip_guard;
pub mod vmnet;

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
