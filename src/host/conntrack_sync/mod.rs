//! conntrackd's connection sync between the hosts of a VIP: its file, the
//! notify script and the anycast guard ([`conntrackd`]), and the gate that
//! keeps a backup's kernel from answering for flows it only learnt
//! ([`gate`]). Driven by `daemon::sync`; the config's part is
//! `config::sync`.

pub mod conntrackd;
pub mod gate;
