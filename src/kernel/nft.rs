//! Running `nft`, reading our table back, removing it.
//!
//! [`read_back`] is this module's one comparison with the kernel: what the
//! table holds of ours, by name, so that a sync after a restart or a failed
//! transaction deletes exactly the objects no longer wanted (a kube-proxy
//! style "full resync"), and never the table itself.

use super::Shard;
use super::build::{Obj, Owned, TABLE};

/// Why `nft` did not do what it was asked.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error(
    "could not {what} the nftables table inet {TABLE}: {detail} (kernel forwarding needs the `nft` command and CAP_NET_ADMIN; the listeners are served by the proxy meanwhile)"
)]
pub struct NftError {
    what: &'static str,
    detail: String,
}

impl NftError {
    pub(super) fn new(what: &'static str, detail: String) -> Self {
        Self { what, detail }
    }

    /// What failed, in nft's own words where it said something.
    pub fn detail(&self) -> &str {
        &self.detail
    }
}

/// Runs `nft` with `args`, `input` on its stdin (see [`crate::nft::run`]).
pub(super) fn run(what: &'static str, args: &[&str], input: &[u8]) -> Result<String, NftError> {
    crate::nft::run(args, input).map_err(|detail| NftError { what, detail })
}

/// Applies one transaction document (atomic: all of it or nothing).
pub(super) fn apply(doc: &serde_json::Value) -> Result<(), NftError> {
    let json = serde_json::to_vec(doc).map_err(|e| NftError {
        what: "write",
        detail: format!("cannot encode it: {e}"),
    })?;
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

fn read_error(detail: String) -> NftError {
    NftError {
        what: "read",
        detail,
    }
}

/// Our tables present now (every shard's, also of a shard this version
/// does not use).
fn our_tables() -> Result<Vec<Shard>, NftError> {
    let names = super::netlink::table_names()
        .map_err(|e| read_error(format!("the tables over netlink: {e}")))?;
    Ok(names.iter().filter_map(|n| Shard::from_table(n)).collect())
}

/// The tables, regular chains, counters and sets ours hold now; empty
/// when there is none (a first start, or a clean stop before).
pub fn read_back() -> Result<Owned, NftError> {
    let mut owned = Owned::default();
    for shard in our_tables()? {
        // Gone between the two calls: nothing to read.
        if let Some(listed) = crate::nft::list_inet_table(&shard.table()).map_err(read_error)? {
            parse_listing(shard, &listed, &mut owned).map_err(read_error)?;
        }
    }
    Ok(owned)
}

/// The objects of a `nft -j list table` answer for table `shard`, into
/// `owned`. Read as plain JSON: the crate's schema has no verdict map
/// type, so it cannot read our own table.
pub(super) fn parse_listing(shard: Shard, listed: &str, owned: &mut Owned) -> Result<(), String> {
    let doc: serde_json::Value =
        serde_json::from_str(listed).map_err(|e| format!("cannot parse nft's listing: {e}"))?;
    owned.tables.insert(shard);
    for o in doc["nftables"].as_array().into_iter().flatten() {
        let name = |kind: &str| {
            o.get(kind)?.get("name")?.as_str().map(|n| Obj {
                shard,
                name: n.to_string(),
            })
        };
        if let Some(n) = name("chain").filter(|_| o["chain"].get("hook").is_none()) {
            owned.chains.insert(n);
        } else if let Some(n) = name("counter") {
            owned.counters.insert(n);
        } else if let Some(n) = name("set").filter(|n| n.name.starts_with("s_")) {
            owned.sets.insert(n);
        } else if let Some(n) = name("set").filter(|n| n.name.starts_with("a_")) {
            owned.affinity.insert(n);
        } else if let Some(n) = name("map").filter(|n| n.name.starts_with("m_")) {
            owned.maps.insert(n);
        }
    }
    Ok(())
}

/// The named counters' packet counts: `(name, packets)`; for NAT chains,
/// one packet is one new connection. Read over netlink, not with `nft`
/// (see `netlink::read_counters`).
pub fn counters() -> Result<Vec<(String, u64)>, NftError> {
    super::netlink::read_counters()
}

/// Deletes every table of ours (a clean stop, after the drain), in one
/// transaction; nothing when there is none.
pub(super) fn remove() -> Result<(), NftError> {
    let removing = |e: NftError| NftError {
        what: "remove",
        detail: e.detail,
    };
    let mut tables = our_tables().map_err(removing)?;
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
