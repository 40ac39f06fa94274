//! Writing the NAT tables with the `nft` command: one transaction document
//! per call, committed by nf_tables whole or not at all, so a packet sees
//! the old tables or the new ones, never half of each.
//!
//! What is written comes from `build` (the transaction, and the text
//! prelude nft's JSON cannot declare); when, from `sync`. A health flip's
//! rewrite of listener chains goes over netlink instead (`netlink`). The
//! `nft` command itself is run by [`crate::host::nft`], for every table the
//! daemon owns.

use super::error::NftError;
use super::names::Shard;
use super::read_back::our_tables_now;

/// Runs `nft` with `args`, `input` on its stdin (see [`crate::host::nft::run`]).
pub(super) fn run(what: &'static str, args: &[&str], input: &[u8]) -> Result<String, NftError> {
    crate::host::nft::run(args, input).map_err(|detail| NftError::new(what, detail.to_string()))
}

/// Applies one transaction document (atomic: all of it or nothing).
pub(super) fn apply(doc: &serde_json::Value) -> Result<(), NftError> {
    let json = serde_json::to_vec(doc)
        .map_err(|e| NftError::new("write", format!("cannot encode it: {e}")))?;
    apply_json(&json)
}

/// Applies one transaction document already encoded as nft's JSON.
pub(super) fn apply_json(json: &[u8]) -> Result<(), NftError> {
    run("write", &["-j", "-f", "-"], json).map(drop)
}

/// Runs a text script before a transaction ([`super::build::prelude`]:
/// what nft's JSON cannot declare); nothing when there is none.
pub(super) fn prepare(script: Option<String>) -> Result<(), NftError> {
    match script {
        Some(text) => run("write", &["-f", "-"], text.as_bytes()).map(drop),
        None => Ok(()),
    }
}

/// Deletes every table of ours (a clean stop, after the drain), in one
/// transaction; nothing when there is none.
pub(super) fn remove() -> Result<(), NftError> {
    let removing = |e: NftError| e.while_doing("remove");
    let mut tables = our_tables_now().map_err(removing)?;
    if !tables.contains(&Shard::MAIN) {
        // `add` first: absent is not an error.
        tables.push(Shard::MAIN);
    }
    let mut cmds = Vec::new();
    for t in tables {
        let table = serde_json::json!({"family": "inet", "name": t.table()});
        cmds.push(serde_json::json!({"add": {"table": table.clone()}}));
        cmds.push(serde_json::json!({"delete": {"table": table}}));
    }
    apply(&serde_json::json!({ "nftables": cmds })).map_err(removing)
}
