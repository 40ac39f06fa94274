//! The `nft` command, run in one place for every table the daemon owns
//! (the VIP isolation table, the NAT tables, the VM-network guard's, the
//! reply marks', the sync gate's and the anycast sync's guard).
//!
//! The `nftables` crate's own runner lets nft's stderr through to ours, so
//! its error cannot say why a transaction was refused; this one keeps it.
//! One call with `-f -` is one atomic transaction: all of it or nothing.

use std::io::Write;
use std::process::{Command, ExitStatus, Stdio};

/// The prefix of every nftables table the daemon owns (`inet
/// harvester_lb`, `inet harvester_lb_nat` and its shards, the VM-network
/// guard's, the reply mark's, the sync gate's, the anycast sync's): what
/// the daemon's own checks of the host's forward chains leave out. Each
/// table's full name is a constant of the module that writes it
/// ([`crate::host::nat::TABLE`], [`crate::host::isolation::TABLE`], …).
pub const TABLE_PREFIX: &str = "harvester_lb";

/// Why `nft` did not do what it was asked: its own words where it said
/// something, else how it ended.
#[derive(Debug, thiserror::Error)]
pub enum NftCommandError {
    /// The command could not be started (not installed, say).
    #[error("cannot run `nft`: {0}")]
    Start(#[source] std::io::Error),
    /// Waiting for it, or reading its output, failed.
    #[error("`nft` did not finish: {0}")]
    Wait(#[source] std::io::Error),
    /// It refused, and said why on stderr ([`condense`]d to one line).
    #[error("nft: {0}")]
    Refused(String),
    /// It failed silently after its stdin could not be written.
    #[error("nft exited with {status} (writing to it: {write})")]
    ExitedUnwritten {
        /// How it ended.
        status: ExitStatus,
        /// Why its stdin could not be written.
        #[source]
        write: std::io::Error,
    },
    /// It failed and said nothing.
    #[error("nft exited with {0}")]
    Exited(ExitStatus),
}

/// Why an `nft -j list …` answer could not be read.
#[derive(Debug, thiserror::Error)]
pub enum NftListingError {
    /// The answer is not JSON.
    #[error("nft's listing is not JSON: {0}")]
    NotJson(#[source] serde_json::Error),
    /// The answer has no `nftables` array.
    #[error("nft's listing has no \"nftables\" array")]
    NoNftablesArray,
}

/// Runs `nft` with `args` and `input` on its stdin. `Ok`: what it printed;
/// `Err`: why not, in nft's own words where it said something.
pub fn run(args: &[&str], input: &[u8]) -> Result<String, NftCommandError> {
    let mut child = Command::new("nft")
        .args(args)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .map_err(NftCommandError::Start)?;
    let written = child.stdin.take().map(|mut stdin| stdin.write_all(input));
    let out = child.wait_with_output().map_err(NftCommandError::Wait)?;
    if out.status.success() {
        return Ok(String::from_utf8_lossy(&out.stdout).into_owned());
    }
    let stderr = String::from_utf8_lossy(&out.stderr);
    let said = condense(&stderr);
    Err(match (said.is_empty(), written) {
        (false, _) => NftCommandError::Refused(said),
        (true, Some(Err(write))) => NftCommandError::ExitedUnwritten {
            status: out.status,
            write,
        },
        (true, _) => NftCommandError::Exited(out.status),
    })
}

/// `nft -j list table inet NAME`: the table as the kernel lists it, `None`
/// when there is none. As before the error became typed, any failure whose
/// text says "No such file or directory" counts as no table.
pub fn list_inet_table(name: &str) -> Result<Option<String>, NftCommandError> {
    match run(&["-j", "list", "table", "inet", name], b"") {
        Ok(listed) => Ok(Some(listed)),
        Err(e) if e.to_string().contains("No such file or directory") => Ok(None),
        Err(e) => Err(e),
    }
}

/// The most distinct lines of nft's error output kept in an error.
const MAX_LINES: usize = 8;
/// The most characters of one line kept.
const MAX_LINE: usize = 400;

/// nft's error output, made fit for one log line: every distinct line once
/// with its count (nft writes one error per refused command, and a
/// transaction of 500 listeners gave 989 copies of one), at most
/// `MAX_LINES` (8) of them of at most `MAX_LINE` (400) characters, the rest
/// counted, joined by `; ` into one line. JSON input has no location, so
/// its `internal:0:0-0: ` prefix is dropped.
pub fn condense(stderr: &str) -> String {
    let mut seen: Vec<(&str, usize)> = Vec::new();
    for line in stderr.lines().map(str::trim).filter(|l| !l.is_empty()) {
        let line = line.strip_prefix("internal:0:0-0: ").unwrap_or(line);
        match seen.iter_mut().find(|(l, _)| *l == line) {
            Some((_, n)) => *n += 1,
            None => seen.push((line, 1)),
        }
    }
    let mut out: Vec<String> = seen
        .iter()
        .take(MAX_LINES)
        .map(|&(line, n)| {
            let mut line = match line.char_indices().nth(MAX_LINE) {
                Some((cut, _)) => format!("{}…", &line[..cut]),
                None => line.to_string(),
            };
            if n > 1 {
                line += &format!(" ({n} times)");
            }
            line
        })
        .collect();
    if seen.len() > MAX_LINES {
        out.push(format!(
            "and {} more distinct lines",
            seen.len() - MAX_LINES
        ));
    }
    out.join("; ")
}

#[cfg(test)]
mod tests {
    use super::{TABLE_PREFIX, condense};

    #[test]
    fn every_table_of_ours_carries_the_prefix() {
        let ours = [
            crate::host::nat::TABLE,
            crate::host::isolation::TABLE,
            crate::host::vmnet::vmnet_filter::TABLE,
            crate::host::vmnet::replymark::TABLE,
            crate::host::conntrack_sync::conntrackd::GATE_TABLE,
            crate::host::conntrack_sync::conntrackd::ANYCAST_TABLE,
        ];
        for table in ours {
            assert!(table.starts_with(TABLE_PREFIX), "{table}");
        }
    }

    #[test]
    fn repeated_errors_are_said_once_with_their_count_and_bounded() {
        let one = "internal:0:0-0: Error: Could not process rule: No such file or directory\n\n";
        assert_eq!(
            condense(&one.repeat(989)),
            "Error: Could not process rule: No such file or directory (989 times)"
        );
        let many: String = (0..50).map(|i| format!("Error: number {i}\n")).collect();
        let said = condense(&many);
        assert_eq!(said.split("; ").count(), 9, "{said}");
        assert!(said.ends_with("and 42 more distinct lines"), "{said}");
        let long = condense(&"x".repeat(10_000));
        assert_eq!(long.chars().count(), 401);
        assert_eq!(condense("  \n"), "");
    }
}
