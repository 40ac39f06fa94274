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
pub(crate) fn run_configured(command: &[String]) -> Result<(), ConfiguredCommandError> {
    let Some((program, args)) = command.split_first() else {
        return Err(ConfiguredCommandError::Empty);
    };
    let out = std::process::Command::new(program)
        .args(args)
        .stdin(std::process::Stdio::null())
        .output()
        .map_err(ConfiguredCommandError::Start)?;
    if out.status.success() {
        return Ok(());
    }
    Err(ConfiguredCommandError::Failed {
        status: out.status,
        stdout: String::from_utf8_lossy(&out.stdout).trim().to_string(),
        stderr: String::from_utf8_lossy(&out.stderr).trim().to_string(),
    })
}

/// Why an operator's configured command failed (`run_configured`).
#[derive(Debug, thiserror::Error)]
pub enum ConfiguredCommandError {
    /// The command has no program.
    #[error("the command is empty")]
    Empty,
    /// The program could not be started.
    #[error(transparent)]
    Start(std::io::Error),
    /// It ran and failed: its exit status, then what it printed.
    #[error("{status}: {stdout}{stderr}")]
    Failed {
        /// How it ended.
        status: std::process::ExitStatus,
        /// Its stdout, trimmed.
        stdout: String,
        /// Its stderr, trimmed.
        stderr: String,
    },
}
