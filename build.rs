//! Build script: the commit the binary is built from, for `--version`,
//! `/status` and `harvester_lb_build_info{commit}`.
//!
//! `HARVESTER_LB_COMMIT` in the build's environment wins (a package built
//! from a source tarball can name its commit); otherwise `git rev-parse`
//! in the source tree; "unknown" outside a git checkout or without git.
//! Only the commit is taken, not whether the tree was dirty: that would
//! rebuild the crate at every edit.

use std::path::Path;
use std::process::Command;

fn main() {
    println!("cargo:rerun-if-env-changed=HARVESTER_LB_COMMIT");
    let commit = std::env::var("HARVESTER_LB_COMMIT")
        .ok()
        .filter(|c| !c.trim().is_empty())
        .or_else(git_commit)
        .unwrap_or_else(|| "unknown".to_string());
    println!("cargo:rustc-env=HARVESTER_LB_COMMIT={}", commit.trim());
}

/// The checked-out commit (12 hex digits), watching HEAD and the branch it
/// names so a new commit builds again.
fn git_commit() -> Option<String> {
    let git = |args: &[&str]| -> Option<String> {
        let out = Command::new("git").args(args).output().ok()?;
        out.status
            .success()
            .then(|| String::from_utf8_lossy(&out.stdout).trim().to_string())
    };
    let commit = git(&["rev-parse", "--short=12", "HEAD"])?;
    if let Some(head) = git(&["rev-parse", "--git-path", "HEAD"]) {
        println!("cargo:rerun-if-changed={head}");
    }
    if let Some(branch) = git(&["symbolic-ref", "-q", "HEAD"])
        && let Some(path) = git(&["rev-parse", "--git-path", &branch])
    {
        println!("cargo:rerun-if-changed={path}");
    }
    if let Some(packed) = git(&["rev-parse", "--git-path", "packed-refs"])
        && Path::new(&packed).exists()
    {
        println!("cargo:rerun-if-changed={packed}");
    }
    Some(commit)
}
