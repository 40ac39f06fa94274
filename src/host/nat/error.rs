//! The one error of the kernel path: why the NAT tables were not written,
//! read back or removed, whichever tool failed (`nft` or netlink).
//!
//! Every file of `host/nat/` imports it from here, none from another: the
//! writers (`commit`, `netlink`), the readers (`read_back`) and the keeper
//! (`sync`) all depend on this module and this module on none of them.

use super::names::TABLE;

/// Why `nft` (or nf_tables over netlink) did not do what it was asked.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error(
    "could not {what} the nftables table inet {TABLE}: {detail} (kernel forwarding needs the `nft` command and CAP_NET_ADMIN; the listeners are served by the proxy meanwhile)"
)]
pub struct NftError {
    what: &'static str,
    detail: String,
}

impl NftError {
    /// `what` the daemon could not do to the table (`write`, `read`, `read
    /// back`, `remove`, `check`), and why (`detail`).
    pub(super) fn new(what: &'static str, detail: String) -> Self {
        Self { what, detail }
    }

    /// The same failure, said of another step (a removal's read, say).
    pub(super) fn while_doing(self, what: &'static str) -> Self {
        Self { what, ..self }
    }

    /// What failed, in nft's own words where it said something.
    pub fn detail(&self) -> &str {
        &self.detail
    }
}
