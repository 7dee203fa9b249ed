//! A Valkey server with `SET … IFEQ` for the tests and the bench, built from source.
//!
//! The sidecar sends a fresh grant's complete as one `SET … IFEQ` where the server has it
//! (Valkey ≥ 8.1, Redis ≥ 8.4) and as a Lua script where it has not; the machines this runs
//! on are Debian 12, whose `redis-server` is 7.0 and whose backports' Valkey is 8.0, so the
//! command's path needs a server of its own. Debian 13's Valkey 8.1.1 is the one taken: its
//! source archive is on the same Debian mirror apt uses (checked against the sha256 its
//! `Sources` index lists), and its binary package cannot run here (built against glibc 2.38+).
//! The build (`make valkey-server`, without TLS; jemalloc, Lua and hiredis are in the
//! archive) takes about 75 s on two cores, once: the server is kept in
//! `target/valkey/`.

use crate::cmd;
use anyhow::{Context, Result, bail};
use sha2::{Digest, Sha256};
use std::path::{Path, PathBuf};
use std::process::Command;

const VERSION: &str = "8.1.1";
/// Debian 13's source archive of Valkey 8.1.1 (`+dfsg1`: repacked without the upstream
/// files Debian does not ship; the server's sources and its bundled libraries are all there).
const ARCHIVE_URL: &str =
    "http://deb.debian.org/debian/pool/main/v/valkey/valkey_8.1.1+dfsg1.orig.tar.xz";
const ARCHIVE_SHA256: &str = "d9bbd82eecb82f359e649a0007ad3dc1b47cc15afa626348ca86b73c4ae2c7ee";

/// The variable the tests and the bench find the built server by
/// (`idemgate_sidecar::testing::valkey_server`).
pub const ENV: &str = "IDEMGATE_VALKEY_SERVER";

/// What the build needs beyond the Rust toolchain: `(binary, Debian package)`.
pub const APT_NEEDS: &[(&str, &str)] = &[
    ("curl", "curl"),
    ("make", "make"),
    ("cc", "gcc"),
    ("xz", "xz-utils"),
];

/// The path of a built `valkey-server` of [`VERSION`], building it if it is not there yet.
pub fn ensure(root: &Path) -> Result<PathBuf> {
    let dir = root.join("target/valkey");
    let server = dir.join(format!("valkey-server-{VERSION}"));
    if reports_version(&server) {
        return Ok(server);
    }
    std::fs::create_dir_all(&dir)?;
    let archive = dir.join(format!("valkey-{VERSION}.tar.xz"));
    if !has_sha256(&archive, ARCHIVE_SHA256)? {
        cmd::step(
            &format!("download Valkey {VERSION}'s source"),
            Command::new("curl")
                .args(["-fsSL", "--retry", "3", "--max-time", "300", "-o"])
                .arg(&archive)
                .arg(ARCHIVE_URL),
        )?;
        if !has_sha256(&archive, ARCHIVE_SHA256)? {
            bail!(
                "{} is not the archive expected (sha256 {ARCHIVE_SHA256})",
                archive.display()
            );
        }
    }
    let source = dir.join(format!("valkey-{VERSION}"));
    if source.exists() {
        std::fs::remove_dir_all(&source)?;
    }
    cmd::step(
        &format!("unpack Valkey {VERSION}"),
        Command::new("tar")
            .arg("xJf")
            .arg(&archive)
            .current_dir(&dir),
    )?;
    cmd::step(
        &format!("build valkey-server {VERSION}"),
        Command::new("make")
            .args(["-j2", "BUILD_TLS=no", "valkey-server"])
            .current_dir(&source)
            .stdout(std::process::Stdio::null()),
    )?;
    std::fs::rename(source.join("src/valkey-server"), &server)
        .context("moving the built valkey-server")?;
    std::fs::remove_dir_all(&source)?;
    if !reports_version(&server) {
        bail!("{} does not report version {VERSION}", server.display());
    }
    Ok(server)
}

fn reports_version(server: &Path) -> bool {
    cmd::output(Command::new(server).arg("--version"))
        .is_some_and(|v| v.contains(&format!("v={VERSION} ")))
}

fn has_sha256(path: &Path, expected: &str) -> Result<bool> {
    match std::fs::read(path) {
        Ok(bytes) => Ok(hex::encode(Sha256::digest(&bytes)) == expected),
        Err(err) if err.kind() == std::io::ErrorKind::NotFound => Ok(false),
        Err(err) => Err(err.into()),
    }
}
