//! `sd_notify(3)` with the standard library alone: `READY=1`, `RELOADING=1`,
//! `STOPPING=1`, `WATCHDOG=1`, `STATUS=…`.
//!
//! Outside systemd (`NOTIFY_SOCKET` unset) every call is a no-op, so tests and
//! a daemon run by hand behave the same.

use std::os::unix::net::UnixDatagram;
use std::time::Duration;

/// Sends one notification; errors are logged at debug and otherwise ignored,
/// as a lost notification must not stop the data plane.
pub fn notify(state: &str) {
    let Some(path) = std::env::var_os("NOTIFY_SOCKET") else {
        return;
    };
    let result = (|| -> std::io::Result<()> {
        let socket = UnixDatagram::unbound()?;
        let bytes = path.as_encoded_bytes();
        if let Some(name) = bytes.strip_prefix(b"@") {
            use std::os::linux::net::SocketAddrExt;
            let addr = std::os::unix::net::SocketAddr::from_abstract_name(name)?;
            socket.send_to_addr(state.as_bytes(), &addr)?;
        } else {
            socket.send_to(state.as_bytes(), &path)?;
        }
        Ok(())
    })();
    if let Err(e) = result {
        tracing::debug!(error = %e, state, "sd_notify failed");
    }
}

/// `RELOADING=1` needs `MONOTONIC_USEC` (systemd 253+ `Type=notify-reload`
/// requires it; older ones ignore it).
pub fn notify_reloading() {
    notify(&format!(
        "RELOADING=1\nMONOTONIC_USEC={}",
        crate::os::monotonic_now().as_micros()
    ));
}

/// The watchdog interval systemd asked for (`WatchdogSec=`), halved as
/// `sd_watchdog_enabled(3)` recommends; `None` when no watchdog is set.
pub fn watchdog_interval() -> Option<Duration> {
    let usec: u64 = std::env::var("WATCHDOG_USEC").ok()?.parse().ok()?;
    if let Some(pid) = std::env::var("WATCHDOG_PID")
        .ok()
        .and_then(|p| p.parse::<u32>().ok())
        && pid != std::process::id()
    {
        return None;
    }
    (usec > 0).then(|| Duration::from_micros(usec / 2))
}
