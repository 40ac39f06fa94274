//! The one rule for a test that cannot run on this machine (a tool, root or
//! `::1` missing): on a developer's machine it says why and returns; under
//! CI (`CI` set, as `.ci/run` runs) it fails, so a machine that lacks a peer
//! can never turn the suite green by testing nothing.
//!
//! A test names what it needs as reasons ([`not_root`], [`missing_tool`],
//! or a bed's own `skip_reason`) and asks [`cannot_run`], which goes
//! through [`skip_or_fail`]: `if cannot_run(test, [not_root()]) { return; }`.

use std::path::{Path, PathBuf};

/// Fails under CI; elsewhere prints `SKIPPED test: why` and lets the caller
/// return. Call it as `if missing { skip_or_fail(..); return; }`.
pub fn skip_or_fail(test: &str, why: &str) {
    assert!(
        std::env::var_os("CI").is_none(),
        "{test} cannot run, and CI must not skip it: {why}"
    );
    eprintln!("SKIPPED {test}: {why}");
}

/// The guard: with the first reason among `needs`, [`skip_or_fail`] and
/// `true` (the caller returns); `false` when every need is met.
pub fn cannot_run(test: &str, needs: impl IntoIterator<Item = Option<String>>) -> bool {
    match needs.into_iter().flatten().next() {
        Some(why) => {
            skip_or_fail(test, &why);
            true
        }
        None => false,
    }
}

/// Why a test that needs root cannot run, if it cannot.
#[allow(unsafe_code)]
pub fn not_root() -> Option<String> {
    // SAFETY: geteuid has no preconditions.
    let euid = unsafe { libc::geteuid() };
    (euid != 0).then(|| format!("needs root (running as uid {euid})"))
}

/// Where `tool` is: a path as given, else the first executable of that name
/// on `PATH` or in the sbin directories (which a user's `PATH` may lack).
pub fn find_tool(tool: &str) -> Option<PathBuf> {
    if tool.contains('/') {
        return Path::new(tool).exists().then(|| PathBuf::from(tool));
    }
    let path = std::env::var_os("PATH").unwrap_or_default();
    std::env::split_paths(&path)
        .chain(["/usr/local/sbin", "/usr/sbin", "/sbin"].map(PathBuf::from))
        .map(|dir| dir.join(tool))
        .find(|p| is_executable(p))
}

/// Why a test that runs `tool` cannot run, if it is not installed, with
/// the Debian package that has it (`.ci/run` installs it).
pub fn missing_tool(tool: &str, package: &str) -> Option<String> {
    find_tool(tool)
        .is_none()
        .then(|| format!("`{tool}` is not installed (Debian package {package})"))
}

fn is_executable(p: &Path) -> bool {
    use std::os::unix::fs::PermissionsExt;
    std::fs::metadata(p).is_ok_and(|m| m.is_file() && m.permissions().mode() & 0o111 != 0)
}
