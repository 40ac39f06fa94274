//! The `nft` command, run in one place for every table the daemon owns
//! (the VIP isolation table, the kernel forwarding table).
//!
//! The `nftables` crate's own runner lets nft's stderr through to ours, so
//! its error cannot say why a transaction was refused; this one keeps it.
//! One call with `-f -` is one atomic transaction: all of it or nothing.

use std::io::Write;
use std::process::{Command, Stdio};

/// Runs `nft` with `args` and `input` on its stdin. `Ok`: what it printed;
/// `Err`: why not, in nft's own words where it said something.
pub fn run(args: &[&str], input: &[u8]) -> Result<String, String> {
    let mut child = Command::new("nft")
        .args(args)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .map_err(|e| format!("cannot run `nft`: {e}"))?;
    let written = child.stdin.take().map(|mut stdin| stdin.write_all(input));
    let out = child
        .wait_with_output()
        .map_err(|e| format!("`nft` did not finish: {e}"))?;
    if out.status.success() {
        return Ok(String::from_utf8_lossy(&out.stdout).into_owned());
    }
    let stderr = String::from_utf8_lossy(&out.stderr);
    let said = stderr.trim();
    Err(match (said.is_empty(), written) {
        (false, _) => format!("nft: {said}"),
        (true, Some(Err(e))) => format!("nft exited with {} (writing to it: {e})", out.status),
        (true, _) => format!("nft exited with {}", out.status),
    })
}

/// `nft -j list table inet NAME`: the table as the kernel lists it, `None`
/// when there is none.
pub fn list_inet_table(name: &str) -> Result<Option<String>, String> {
    match run(&["-j", "list", "table", "inet", name], b"") {
        Ok(listed) => Ok(Some(listed)),
        Err(e) if e.contains("No such file or directory") => Ok(None),
        Err(e) => Err(e),
    }
}
