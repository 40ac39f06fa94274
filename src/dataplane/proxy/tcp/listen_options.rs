//! The socket options of a TCP listener that the operator chooses per
//! listener (`[[load_balancer.listener]]`), all off by default because they
//! change what a client sees: today `TCP_DEFER_ACCEPT`
//! (`defer_accept_seconds`).
//!
//! Options the daemon always wants (`TCP_NODELAY`, keepalive,
//! `TCP_USER_TIMEOUT`) are not here: [`super::bind`] sets them once on every
//! listening socket and accepted sockets inherit them.
//!
//! Every option here can change on a live listening socket, so a reload
//! applies a change to the socket in place ([`super::Listener::set_options`]):
//! no rebind, no refused client. It applies to handshakes from then on.

use std::io;
use std::os::fd::AsRawFd;
use std::time::Duration;

use crate::config::ListenerSpec;

/// What a listener's socket is asked for beyond the daemon's own defaults.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ListenerOptions {
    /// `TCP_DEFER_ACCEPT`: hand a client over only once it has sent
    /// something (or after this long). Saves the accept wake-up, the backend
    /// connect and the empty read for a client that connects and stays
    /// silent, and lets the first read find the request already there.
    /// Wrong for protocols where the server speaks first (SMTP, MySQL,
    /// SSH). `None`: off, the kernel's default.
    pub defer_accept: Option<Duration>,
}

impl ListenerOptions {
    /// The options `spec` asks for.
    pub fn of(spec: &ListenerSpec) -> Self {
        Self {
            defer_accept: spec.defer_accept,
        }
    }

    /// Sets every option on the listening `socket`: the ones turned off as
    /// well, so that applying new options after a reload undoes the old.
    /// Errors name the option.
    pub fn apply(&self, socket: &impl AsRawFd) -> io::Result<()> {
        let seconds = self
            .defer_accept
            .map_or(0, |d| u32::try_from(d.as_secs()).unwrap_or(u32::MAX));
        crate::os::set_tcp_defer_accept(socket.as_raw_fd(), seconds)
            .map_err(|e| io::Error::new(e.kind(), format!("cannot set TCP_DEFER_ACCEPT: {e}")))
    }
}
