//! conntrackd's connection sync between the hosts of a VIP: its file, the
//! notify script and the anycast guard ([`conntrackd`]), and the gate that
//! keeps a backup's kernel from answering for flows it only learnt
//! ([`gate`]), and the component that runs each step of it ([`syncer`],
//! called by the daemon's VM-network task). The config's part is
//! `config::sync`.

pub mod conntrackd;
pub mod gate;
pub mod syncer;
