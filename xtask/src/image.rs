//! `cargo xtask image`: the two images the Kubernetes bundle references, built offline and
//! tested without running a container (these machines cannot: the sandbox refuses the
//! runtime's setrlimit).
//!
//! - **The sidecar image** (`images/sidecar-prebuilt.Containerfile`): `FROM scratch`, the
//!   sidecar binary built here and the shared libraries it links (glibc, libgcc_s, the
//!   loader), user 65532. Built by `podman build --storage-driver vfs`, copied out as an OCI
//!   layout by `skopeo`, unpacked by `umoci`; then its entrypoint runs from the unpacked root
//!   (`chroot --userspec` with the image config's numeric user, the image config's
//!   environment): it must answer `/healthz`, run as that uid, and reach a real Redis by a
//!   Kubernetes-style short hostname through DNS (a `dnsmasq` on loopback, named by the
//!   root's `/etc/resolv.conf` as a kubelet would) — and fail its `--check` on a name that
//!   does not resolve.
//! - **The filter image** (`images/filter.Containerfile`): the Wasm image specification's
//!   "compat" variant, the one layout both Istio's and Envoy Gateway's fetchers accept with
//!   a single layer (`pkg/wasm/imagefetcher.go` in istio/istio and `internal/wasm/
//!   imagefetcher.go` in envoyproxy/gateway: the last layer, media type
//!   `application/vnd.oci.image.layer.v1.tar+gzip`, a file named `plugin.wasm`; their
//!   other, custom-media-type variant requires exactly two layers). The check reads the
//!   layout itself: every blob's sha256 is its digest, one layer of that media type, its
//!   gunzipped tar is the config's `diff_id` and holds `plugin.wasm` equal to
//!   `target/idemgate.wasm`.
//!
//! Both images are built with `--timestamp 0`, so the same binary and module give the same
//! manifest digests; the digests are printed and written to `target/image/digests.txt` for
//! pinning (envoy/README.md, "Images").

use crate::cmd;
use anyhow::{Context, Result, bail, ensure};
use serde_json::Value;
use sha2::{Digest, Sha256};
use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream, UdpSocket};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// The tag of both images: the workspace version.
const TAG: &str = env!("CARGO_PKG_VERSION");
const SIDECAR: &str = "idemgate-sidecar";
const FILTER: &str = "idemgate-filter";
/// Where the image puts the binary; the entrypoint of both sidecar Containerfiles.
const SIDECAR_PATH: &str = "usr/local/bin/idemgate-sidecar";
/// The compat variant's layer media type and file name (see the module docs).
const COMPAT_LAYER: &str = "application/vnd.oci.image.layer.v1.tar+gzip";
const COMPAT_FILE: &str = "plugin.wasm";
const OCI_MANIFEST: &str = "application/vnd.oci.image.manifest.v1+json";
/// The loopback DNS server of the sidecar test. resolv.conf cannot name a port, so it is
/// port 53, on an address of its own in 127/8.
const DNS_ADDR: &str = "127.0.0.77";
/// The base's `REDIS_URL` host (`redis://idemgate-redis:6379`), resolved through the search
/// list of a pod in namespace `idemgate`, as in Kubernetes.
const REDIS_HOST: &str = "idemgate-redis";
const POD_SEARCH: &str = "idemgate.svc.cluster.local svc.cluster.local cluster.local";
/// Every wait of the sidecar test is bounded by this.
const WAIT: Duration = Duration::from_secs(20);

/// What the build and its test run (`(need, Debian package)`, as `toolchain::ensure_apt`
/// takes them). `podman build` is buildah inside; the `buildah` command itself is not used.
pub const APT_NEEDS: &[(&str, &str)] = &[
    ("podman", "podman"),
    ("skopeo", "skopeo"),
    ("umoci", "umoci"),
    ("dnsmasq", "dnsmasq-base"),
    ("redis-server", "redis-server"),
];

/// `cargo xtask image [--dev | --tests-binary]`: the release sidecar (or the dev profile, or
/// the binary the integration tests built, as `cargo xtask test` uses) and the filter, built,
/// assembled and checked.
pub fn command(root: &Path, args: &[String]) -> Result<()> {
    let wasm = crate::wasm::build_all(root)?;
    let sidecar = match args {
        [] => build_sidecar(root, true)?,
        [flag] if flag == "--dev" => build_sidecar(root, false)?,
        [flag] if flag == "--tests-binary" => built_by_the_tests(root)?,
        _ => bail!("usage: cargo xtask image [--dev | --tests-binary]"),
    };
    build_and_check(root, &sidecar, &wasm)
}

/// Builds the sidecar binary (the shipped `dist` profile or the dev profile) and returns its path, as cargo
/// reports it.
pub fn build_sidecar(root: &Path, release: bool) -> Result<PathBuf> {
    let mut cargo = cmd::cargo();
    cargo
        .args(["build", "-p", SIDECAR, "--bin", SIDECAR])
        .args(["--message-format", "json-render-diagnostics"])
        .current_dir(root)
        .stderr(Stdio::inherit());
    // `dist`: the release profile with whole-program optimization (Cargo.toml), what the
    // image ships.
    let profile = if release { "dist" } else { "dev" };
    cargo.args(["--profile", profile]);
    println!("==> sidecar binary ({profile}): cargo build -p {SIDECAR}");
    let started = Instant::now();
    let out = cargo.output().context("running cargo build")?;
    ensure!(out.status.success(), "building the sidecar failed");
    let executable = String::from_utf8_lossy(&out.stdout)
        .lines()
        .filter_map(|line| serde_json::from_str::<Value>(line).ok())
        .filter(|m| m["reason"] == "compiler-artifact" && m["target"]["name"] == SIDECAR)
        .find_map(|m| m["executable"].as_str().map(PathBuf::from))
        .context("cargo reported no sidecar executable")?;
    println!("==> sidecar binary: ok in {:.1?}", started.elapsed());
    Ok(executable)
}

/// The sidecar binary `cargo test --workspace --test '*'` has just built (cargo builds a
/// package's binaries for its integration tests), with the workspace's test-time features:
/// the binary every other test exercised. `cargo build -p idemgate-sidecar` would rebuild it
/// and its dependencies with other features (tokio's `test-util` is a dev-dependency).
/// Refused when a source of it is newer, i.e. when that build has not run since an edit.
pub fn built_by_the_tests(root: &Path) -> Result<PathBuf> {
    let binary = root.join("target/debug").join(SIDECAR);
    let built = std::fs::metadata(&binary)
        .and_then(|m| m.modified())
        .with_context(|| format!("{}: not built by the integration tests", binary.display()))?;
    let mut dirs = vec![root.join("sidecar/src"), root.join("wire/src")];
    let mut checked = 0;
    while let Some(dir) = dirs.pop() {
        for entry in
            std::fs::read_dir(&dir).with_context(|| format!("reading {}", dir.display()))?
        {
            let path = entry?.path();
            if path.is_dir() {
                dirs.push(path);
            } else if std::fs::metadata(&path)?.modified()? > built {
                bail!(
                    "{} is older than {}: build it first",
                    binary.display(),
                    path.display()
                );
            }
            checked += 1;
            ensure!(checked < 10_000, "too many files under sidecar/ and wire/");
        }
    }
    Ok(binary)
}

/// Builds both images from `sidecar` and `wasm`, checks them, prints their digests.
pub fn build_and_check(root: &Path, sidecar: &Path, wasm: &Path) -> Result<()> {
    ensure!(
        is_root(),
        "`cargo xtask image` runs as root: vfs storage and the chroot of the sidecar test need it"
    );
    crate::toolchain::ensure_apt(APT_NEEDS)?;
    let started = Instant::now();
    let work = root.join("target/image");
    if work.exists() {
        std::fs::remove_dir_all(&work).context("clearing target/image")?;
    }
    let podman = Podman::new(&work);
    check_final_stages_agree(root)?;

    let context = work.join("sidecar-context");
    stage_sidecar(sidecar, &context.join("rootfs"))?;
    let sidecar_layout = work.join(SIDECAR);
    podman.build(
        &root.join("images/sidecar-prebuilt.Containerfile"),
        &context,
        SIDECAR,
        &sidecar_layout,
    )?;
    let sidecar_image = Layout::open(&sidecar_layout, TAG)?;
    check_sidecar(&sidecar_image, &work.join("sidecar-bundle"))?;

    let context = work.join("filter-context");
    std::fs::create_dir_all(&context)?;
    std::fs::copy(wasm, context.join("idemgate.wasm")).context("staging the module")?;
    let filter_layout = work.join(FILTER);
    podman.build(
        &root.join("images/filter.Containerfile"),
        &context,
        FILTER,
        &filter_layout,
    )?;
    let filter_image = Layout::open(&filter_layout, TAG)?;
    let module = std::fs::read(wasm).with_context(|| format!("reading {}", wasm.display()))?;
    let layer = check_filter(&filter_image, &module)?;

    let report = format!(
        "sidecar image  {SIDECAR}:{TAG}  OCI layout {}\n  \
         manifest  {}   (kustomize `images:` digest)\n\
         filter image   {FILTER}:{TAG}  OCI layout {}\n  \
         manifest  {}   (Istio `url: oci://...@` and `sha256:`, Envoy Gateway `url: ...@` and `sha256:`)\n  \
         layer     {}   (tar+gzip holding {COMPAT_FILE})\n  \
         module    sha256:{}   (= {})\n",
        sidecar_layout.display(),
        sidecar_image.manifest_digest,
        filter_layout.display(),
        filter_image.manifest_digest,
        layer,
        hex::encode(Sha256::digest(&module)),
        wasm.display(),
    );
    std::fs::write(work.join("digests.txt"), &report).context("writing digests.txt")?;
    print!("{report}");
    println!("==> images: ok in {:.1?}", started.elapsed());
    Ok(())
}

/// The two sidecar Containerfiles' final stages must describe the same image: every line
/// after the last `FROM` that is not a `COPY` (user, environment, port, entrypoint).
fn check_final_stages_agree(root: &Path) -> Result<()> {
    let final_stage = |name: &str| -> Result<Vec<String>> {
        let text = std::fs::read_to_string(root.join("images").join(name))
            .with_context(|| format!("reading images/{name}"))?;
        let lines: Vec<&str> = text
            .lines()
            .map(str::trim)
            .filter(|l| !l.is_empty() && !l.starts_with('#'))
            .collect();
        let start = lines
            .iter()
            .rposition(|l| l.starts_with("FROM "))
            .with_context(|| format!("images/{name} has no FROM"))?;
        Ok(lines
            .get(start + 1..)
            .unwrap_or_default()
            .iter()
            .filter(|l| !l.starts_with("COPY "))
            .map(|l| l.to_string())
            .collect())
    };
    let source = final_stage("sidecar.Containerfile")?;
    let prebuilt = final_stage("sidecar-prebuilt.Containerfile")?;
    ensure!(
        source == prebuilt,
        "the final stages of images/sidecar.Containerfile and images/sidecar-prebuilt.Containerfile \
         differ:\n  {source:?}\n  {prebuilt:?}"
    );
    println!("==> sidecar Containerfiles: final stages agree ({prebuilt:?})");
    Ok(())
}

/// Copies the binary and every library `ldd` names to the same paths under `rootfs`.
fn stage_sidecar(binary: &Path, rootfs: &Path) -> Result<()> {
    let ldd = cmd::output(Command::new("ldd").arg(binary))
        .with_context(|| format!("ldd {} failed", binary.display()))?;
    ensure!(!ldd.contains("not found"), "ldd: missing libraries:\n{ldd}");
    let mut files = vec![(binary.to_path_buf(), rootfs.join(SIDECAR_PATH))];
    for library in ldd.split_whitespace().filter(|word| word.starts_with('/')) {
        let inside = rootfs.join(library.trim_start_matches('/'));
        files.push((PathBuf::from(library), inside));
    }
    for (from, to) in &files {
        if let Some(dir) = to.parent() {
            std::fs::create_dir_all(dir)?;
        }
        // `copy` follows symlinks (the loader is one on Debian): the image gets the file.
        std::fs::copy(from, to)
            .with_context(|| format!("copying {} into the image", from.display()))?;
    }
    let names: Vec<String> = files.iter().map(|(f, _)| f.display().to_string()).collect();
    println!("==> sidecar image files: {}", names.join(", "));
    Ok(())
}

/// podman (and skopeo reading its store) on a vfs store of its own under `target/image`.
struct Podman {
    storage: PathBuf,
    runroot: PathBuf,
}

impl Podman {
    fn new(work: &Path) -> Self {
        Self {
            storage: work.join("storage"),
            runroot: work.join("run"),
        }
    }

    /// `podman build`, then the image copied out to an OCI layout at `layout`, tag [`TAG`].
    fn build(&self, containerfile: &Path, context: &Path, name: &str, layout: &Path) -> Result<()> {
        let image = format!("localhost/{name}:{TAG}");
        cmd::step(
            &format!("podman build {name}"),
            Command::new("podman")
                .arg("--storage-driver=vfs")
                .arg("--root")
                .arg(&self.storage)
                .arg("--runroot")
                .arg(&self.runroot)
                .args(["build", "--quiet", "--timestamp", "0", "--tag", &image])
                .arg("--file")
                .arg(containerfile)
                .arg(context),
        )?;
        let store = format!(
            "containers-storage:[vfs@{}+{}]{image}",
            self.storage.display(),
            self.runroot.display()
        );
        cmd::step(
            &format!("skopeo copy {name} to an OCI layout"),
            Command::new("skopeo")
                .args(["copy", "--quiet", &store])
                .arg(format!("oci:{}:{TAG}", layout.display())),
        )
    }
}

/// One image of an OCI layout, every blob it references checked against its digest.
struct Layout {
    dir: PathBuf,
    manifest_digest: String,
    manifest: Value,
    config: Value,
}

impl Layout {
    fn open(dir: &Path, tag: &str) -> Result<Self> {
        let index: Value = serde_json::from_slice(
            &std::fs::read(dir.join("index.json")).context("reading index.json")?,
        )?;
        let descriptor = index["manifests"]
            .as_array()
            .into_iter()
            .flatten()
            .find(|m| m["annotations"]["org.opencontainers.image.ref.name"] == tag)
            .with_context(|| format!("{}: no manifest tagged {tag}", dir.display()))?;
        ensure!(
            descriptor["mediaType"] == OCI_MANIFEST,
            "manifest media type {}",
            descriptor["mediaType"]
        );
        let mut layout = Self {
            dir: dir.to_path_buf(),
            manifest_digest: string(&descriptor["digest"])?,
            manifest: Value::Null,
            config: Value::Null,
        };
        layout.manifest = serde_json::from_slice(&layout.blob(descriptor)?)?;
        layout.config = serde_json::from_slice(&layout.blob(&layout.manifest["config"])?)?;
        for layer in layout.layers() {
            layout.blob(layer)?;
        }
        Ok(layout)
    }

    fn layers(&self) -> impl Iterator<Item = &Value> {
        self.manifest["layers"].as_array().into_iter().flatten()
    }

    /// The blob a descriptor names, refused unless its sha256 and size are the descriptor's.
    fn blob(&self, descriptor: &Value) -> Result<Vec<u8>> {
        let digest = string(&descriptor["digest"])?;
        let hex = digest
            .strip_prefix("sha256:")
            .with_context(|| format!("digest {digest} is not sha256"))?;
        let bytes = std::fs::read(self.dir.join("blobs/sha256").join(hex))
            .with_context(|| format!("blob {digest} missing"))?;
        let actual = hex::encode(Sha256::digest(&bytes));
        ensure!(
            actual == hex,
            "blob {digest} has sha256 {actual}: not the digest it is stored under"
        );
        ensure!(
            descriptor["size"].as_u64() == Some(bytes.len() as u64),
            "blob {digest}: size {} but the descriptor says {}",
            bytes.len(),
            descriptor["size"]
        );
        Ok(bytes)
    }
}

fn string(value: &Value) -> Result<String> {
    value
        .as_str()
        .map(str::to_owned)
        .with_context(|| format!("expected a string, got {value}"))
}

/// The filter image as both fetchers read it; returns the layer's digest.
fn check_filter(image: &Layout, module: &[u8]) -> Result<String> {
    let layers: Vec<&Value> = image.layers().collect();
    let [layer] = layers.as_slice() else {
        bail!("the filter image has {} layers, not one", layers.len());
    };
    ensure!(
        layer["mediaType"] == COMPAT_LAYER,
        "layer media type {} (the fetchers want {COMPAT_LAYER})",
        layer["mediaType"]
    );
    // Layout::open has already checked that the layer's digest is the sha256 of its bytes
    // (the gzipped tar); here, that the tar inside is the config's diff_id and holds the
    // module, byte for byte.
    let mut tar_bytes = Vec::new();
    flate2::read::GzDecoder::new(image.blob(layer)?.as_slice())
        .read_to_end(&mut tar_bytes)
        .context("the layer is not gzip")?;
    let diff_id = format!("sha256:{}", hex::encode(Sha256::digest(&tar_bytes)));
    ensure!(
        image.config["rootfs"]["diff_ids"] == serde_json::json!([diff_id]),
        "config diff_ids {} but the layer's tar is {diff_id}",
        image.config["rootfs"]["diff_ids"]
    );
    let mut files = Vec::new();
    let mut archive = tar::Archive::new(tar_bytes.as_slice());
    for entry in archive.entries().context("reading the layer's tar")? {
        let mut entry = entry?;
        if !entry.header().entry_type().is_file() {
            continue;
        }
        let name = entry.path()?.to_string_lossy().into_owned();
        let mut content = Vec::new();
        entry.read_to_end(&mut content)?;
        files.push((name, content));
    }
    let [(name, content)] = files.as_slice() else {
        let names: Vec<&str> = files.iter().map(|(n, _)| n.as_str()).collect();
        bail!("the layer holds {names:?}, not just {COMPAT_FILE}");
    };
    ensure!(
        name.trim_start_matches("./") == COMPAT_FILE,
        "the layer holds {name}"
    );
    ensure!(
        content.as_slice() == module,
        "{COMPAT_FILE} in the layer is not target/idemgate.wasm"
    );
    println!(
        "==> filter image: one {COMPAT_LAYER} layer {}, its tar {diff_id} holds {COMPAT_FILE} = the module",
        string(&layer["digest"])?
    );
    string(&layer["digest"])
}

/// Unpacks the sidecar image and runs its entrypoint from the unpacked root as the image's
/// user, with the image's environment.
fn check_sidecar(image: &Layout, bundle: &Path) -> Result<()> {
    let config = &image.config["config"];
    let user = string(&config["User"]).context("the sidecar image sets no User")?;
    let (uid, gid) = numeric_user(&user)?;
    let entrypoint: Vec<String> = config["Entrypoint"]
        .as_array()
        .context("the sidecar image has no Entrypoint")?
        .iter()
        .map(string)
        .collect::<Result<_>>()?;
    ensure!(
        entrypoint == [format!("/{SIDECAR_PATH}")],
        "entrypoint {entrypoint:?}"
    );
    let env: Vec<(String, String)> = config["Env"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(|e| e.as_str()?.split_once('='))
        .map(|(k, v)| (k.to_owned(), v.to_owned()))
        .collect();
    cmd::step(
        "umoci unpack the sidecar image",
        Command::new("umoci")
            .args(["unpack", "--image"])
            .arg(format!("{}:{TAG}", image.dir.display()))
            .arg(bundle),
    )?;
    let rootfs = bundle.join("rootfs");
    // The runtime's part (a kubelet writes the pod's resolv.conf): DNS on loopback, the
    // pod's search list, Kubernetes' ndots.
    std::fs::create_dir_all(rootfs.join("etc"))?;
    std::fs::write(
        rootfs.join("etc/resolv.conf"),
        format!("nameserver {DNS_ADDR}\nsearch {POD_SEARCH}\noptions ndots:5\n"),
    )?;
    let logs = bundle.join("logs");
    let dns = start_dns(&logs)?;
    let redis_port = free_port()?;
    let redis = Process::spawn(
        "redis-server",
        &logs,
        Command::new("redis-server")
            .args(["--bind", "127.0.0.1", "--port", &redis_port.to_string()])
            .args(["--save", "", "--appendonly", "no"]),
    )?;
    wait_for("redis-server", || {
        TcpStream::connect(("127.0.0.1", redis_port)).is_ok()
    })?;
    let run = |args: &[&str], redis_host: &str, listen: SocketAddr| {
        let mut command = Command::new("chroot");
        command
            .arg(format!("--userspec={uid}:{gid}"))
            .arg(&rootfs)
            .args(&entrypoint)
            .args(args)
            .env_clear()
            .envs(env.iter().map(|(k, v)| (k, v)))
            .env("IDEMGATE_LISTEN", listen.to_string())
            .env("REDIS_URL", format!("redis://{redis_host}:{redis_port}"));
        command
    };
    let loopback = SocketAddr::from(([127, 0, 0, 1], free_port()?));

    // The init container's `--check`: resolves the base's short Redis name through DNS and
    // passes; a name DNS does not know must fail it, or the first proves nothing.
    let check = |redis_host: &str| -> Result<(bool, Process)> {
        let name = format!("sidecar --check {redis_host}");
        let mut check = Process::spawn(&name, &logs, &mut run(&["--check"], redis_host, loopback))?;
        Ok((check.wait(WAIT)?.success(), check))
    };
    let (passed, process) = check(REDIS_HOST)?;
    ensure!(
        passed,
        "--check from the image failed: {}",
        process.output()
    );
    let (passed, process) = check("no-such-redis")?;
    ensure!(
        !passed,
        "--check passed with a Redis hostname DNS does not know: {}",
        process.output()
    );
    println!(
        "==> sidecar image: --check passes with redis://{REDIS_HOST} (DNS), fails with an unknown name"
    );

    // Serving: /healthz, /readyz (Redis reached by name), and the process's real ids.
    let mut server = Process::spawn("sidecar", &logs, &mut run(&[], REDIS_HOST, loopback))?;
    wait_for("the sidecar's /healthz", || {
        http_status(loopback, "/healthz") == Some(200)
    })
    .with_context(|| server.output())?;
    wait_for("the sidecar's /readyz (Redis by name)", || {
        http_status(loopback, "/readyz") == Some(200)
    })
    .with_context(|| server.output())?;
    let status = std::fs::read_to_string(format!("/proc/{}/status", server.child.id()))
        .context("reading the sidecar's /proc status")?;
    let ids = |field: &str| -> Vec<String> {
        status
            .lines()
            .find_map(|l| l.strip_prefix(field))
            .map(|v| v.split_whitespace().map(str::to_owned).collect())
            .unwrap_or_default()
    };
    let (uids, gids) = (ids("Uid:"), ids("Gid:"));
    ensure!(
        uids.len() == 4 && uids.iter().all(|u| *u == uid.to_string()),
        "the sidecar runs with uids {uids:?}, not {uid}"
    );
    ensure!(
        gids.len() == 4 && gids.iter().all(|g| *g == gid.to_string()),
        "the sidecar runs with gids {gids:?}, not {gid}"
    );
    println!(
        "==> sidecar image: entrypoint {} answers /healthz and /readyz on {loopback}, runs as \
         uid {uid} gid {gid} (real, effective, saved, fs; the image's User {user:?})",
        entrypoint.join(" ")
    );
    server.stop()?;
    drop((redis, dns));
    Ok(())
}

/// `uid[:gid]`, numeric and not root (Kubernetes' `runAsNonRoot` can only verify a number).
fn numeric_user(user: &str) -> Result<(u32, u32)> {
    let (uid, gid) = user.split_once(':').unwrap_or((user, user));
    let (Ok(uid), Ok(gid)) = (uid.parse::<u32>(), gid.parse::<u32>()) else {
        bail!("image User {user:?} is not numeric");
    };
    ensure!(uid != 0 && gid != 0, "image User {user:?} is root");
    Ok((uid, gid))
}

/// dnsmasq on [`DNS_ADDR`]:53 answering the base's Redis Service name with loopback.
fn start_dns(logs: &Path) -> Result<Process> {
    let address = format!("{DNS_ADDR}:53");
    // Bound means something else answers there, and the test would ask it instead.
    ensure!(
        UdpSocket::bind(&address).is_ok(),
        "{address} is taken: the sidecar image test runs its own DNS server there"
    );
    let dns = Process::spawn(
        "dnsmasq",
        logs,
        Command::new("dnsmasq")
            .args([
                "--keep-in-foreground",
                "--no-resolv",
                "--no-hosts",
                "--bind-interfaces",
            ])
            .arg("--port=53")
            .arg(format!("--pid-file={}", logs.join("dnsmasq.pid").display()))
            .arg(format!("--listen-address={DNS_ADDR}"))
            .arg(format!(
                "--address=/{REDIS_HOST}.{}/127.0.0.1",
                POD_SEARCH.split(' ').next().unwrap_or_default()
            )),
    )?;
    wait_for("dnsmasq", || UdpSocket::bind(&address).is_err())?;
    Ok(dns)
}

/// A child process that is killed and reaped when dropped.
struct Process {
    name: String,
    log_path: PathBuf,
    child: Child,
}

impl Process {
    /// Starts `command` with its output in `logs/<name>.log`.
    fn spawn(name: &str, logs: &Path, command: &mut Command) -> Result<Self> {
        std::fs::create_dir_all(logs)?;
        let log_path = logs.join(format!("{}.log", name.replace([' ', '-'], "_")));
        let log = std::fs::File::create(&log_path)?;
        let child = command
            .stdin(Stdio::null())
            .stdout(log.try_clone()?)
            .stderr(log)
            .spawn()
            .with_context(|| format!("starting {name}"))?;
        Ok(Self {
            name: name.to_owned(),
            log_path,
            child,
        })
    }

    /// The process's output so far, for error messages.
    fn output(&self) -> String {
        let text = std::fs::read_to_string(&self.log_path).unwrap_or_default();
        let lines: Vec<&str> = text.lines().collect();
        let tail = lines
            .get(lines.len().saturating_sub(20)..)
            .unwrap_or_default();
        format!(
            "{} (last lines of {}):\n{}",
            self.name,
            self.log_path.display(),
            tail.join("\n")
        )
    }

    /// Waits at most `limit` for the process to exit by itself.
    fn wait(&mut self, limit: Duration) -> Result<std::process::ExitStatus> {
        let deadline = Instant::now() + limit;
        while Instant::now() < deadline {
            if let Some(status) = self.child.try_wait()? {
                return Ok(status);
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        bail!("did not exit within {limit:?}: {}", self.output())
    }

    /// SIGTERM, as a runtime stops a container, then a bounded wait for the exit.
    fn stop(&mut self) -> Result<()> {
        cmd::step(
            &format!("SIGTERM {}", self.name),
            Command::new("kill").args(["-TERM", &self.child.id().to_string()]),
        )?;
        let status = self.wait(WAIT)?;
        ensure!(
            status.success(),
            "{} exited with {status} on SIGTERM",
            self.name
        );
        Ok(())
    }
}

impl Drop for Process {
    fn drop(&mut self) {
        if let Ok(None) = self.child.try_wait() {
            let _ = self.child.kill();
        }
        let _ = self.child.wait();
    }
}

/// Polls `ready` every 50 ms for at most [`WAIT`].
fn wait_for(what: &str, mut ready: impl FnMut() -> bool) -> Result<()> {
    let deadline = Instant::now() + WAIT;
    while Instant::now() < deadline {
        if ready() {
            return Ok(());
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    bail!("{what}: not ready within {WAIT:?}")
}

fn free_port() -> Result<u16> {
    Ok(TcpListener::bind("127.0.0.1:0")?.local_addr()?.port())
}

/// The status of `GET path` over HTTP/1.1, or `None` when there is no answer.
fn http_status(addr: SocketAddr, path: &str) -> Option<u16> {
    let mut stream = TcpStream::connect_timeout(&addr, Duration::from_secs(1)).ok()?;
    stream.set_read_timeout(Some(Duration::from_secs(2))).ok()?;
    write!(
        stream,
        "GET {path} HTTP/1.1\r\nhost: sidecar\r\nconnection: close\r\n\r\n"
    )
    .ok()?;
    let mut head = [0u8; 12];
    stream.read_exact(&mut head).ok()?;
    std::str::from_utf8(head.get(9..12)?).ok()?.parse().ok()
}

fn is_root() -> bool {
    cmd::output(Command::new("id").arg("-u")).is_some_and(|uid| uid.trim() == "0")
}

#[cfg(test)]
mod tests {
    use super::*;

    const MODULE: &[u8] = b"\0asm\x01\0\0\0 the module";

    /// A gzipped tar of `files` and the sha256 of the tar (its diff_id).
    fn tar_gz(files: &[(&str, &[u8])]) -> (Vec<u8>, String) {
        let mut builder = tar::Builder::new(Vec::new());
        for (name, content) in files {
            let mut header = tar::Header::new_gnu();
            header.set_size(content.len() as u64);
            header.set_mode(0o644);
            header.set_cksum();
            builder.append_data(&mut header, name, *content).unwrap();
        }
        let tar = builder.into_inner().unwrap();
        let diff_id = format!("sha256:{}", hex::encode(Sha256::digest(&tar)));
        let mut gz = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::default());
        gz.write_all(&tar).unwrap();
        (gz.finish().unwrap(), diff_id)
    }

    fn put(dir: &Path, bytes: &[u8], media_type: &str) -> Value {
        let hex = hex::encode(Sha256::digest(bytes));
        std::fs::write(dir.join("blobs/sha256").join(&hex), bytes).unwrap();
        serde_json::json!({"mediaType": media_type, "digest": format!("sha256:{hex}"), "size": bytes.len()})
    }

    /// A one-image OCI layout, tagged [`TAG`], with these layers.
    fn layout(layers: &[(&str, Vec<u8>, String)]) -> tempfile::TempDir {
        let dir = tempfile::tempdir().unwrap();
        std::fs::create_dir_all(dir.path().join("blobs/sha256")).unwrap();
        let diff_ids: Vec<&String> = layers.iter().map(|(_, _, d)| d).collect();
        let config = serde_json::json!({"rootfs": {"type": "layers", "diff_ids": diff_ids}});
        let config = put(
            dir.path(),
            config.to_string().as_bytes(),
            "application/vnd.oci.image.config.v1+json",
        );
        let layers: Vec<Value> = layers
            .iter()
            .map(|(media_type, blob, _)| put(dir.path(), blob, media_type))
            .collect();
        let manifest = serde_json::json!({
            "schemaVersion": 2, "mediaType": OCI_MANIFEST, "config": config, "layers": layers,
        });
        let mut descriptor = put(dir.path(), manifest.to_string().as_bytes(), OCI_MANIFEST);
        descriptor["annotations"] = serde_json::json!({"org.opencontainers.image.ref.name": TAG});
        let index = serde_json::json!({"schemaVersion": 2, "manifests": [descriptor]});
        std::fs::write(dir.path().join("index.json"), index.to_string()).unwrap();
        dir
    }

    fn check(dir: &tempfile::TempDir) -> Result<String> {
        check_filter(&Layout::open(dir.path(), TAG)?, MODULE)
    }

    #[test]
    fn the_compat_layout_holding_the_module_passes() {
        let (blob, diff_id) = tar_gz(&[(COMPAT_FILE, MODULE)]);
        let layer = format!("sha256:{}", hex::encode(Sha256::digest(&blob)));
        let dir = layout(&[(COMPAT_LAYER, blob, diff_id)]);
        assert_eq!(check(&dir).unwrap(), layer);
    }

    #[test]
    fn a_layer_whose_bytes_are_not_its_digest_is_refused() {
        let (blob, diff_id) = tar_gz(&[(COMPAT_FILE, MODULE)]);
        let hex = hex::encode(Sha256::digest(&blob));
        let dir = layout(&[(COMPAT_LAYER, blob, diff_id)]);
        let (other, _) = tar_gz(&[(COMPAT_FILE, b"\0asm\x01\0\0\0 other")]);
        std::fs::write(dir.path().join("blobs/sha256").join(hex), other).unwrap();
        let err = check(&dir).unwrap_err().to_string();
        assert!(err.contains("not the digest it is stored under"), "{err}");
    }

    #[test]
    fn layouts_the_fetchers_would_not_load_are_refused() {
        let (blob, diff_id) = tar_gz(&[(COMPAT_FILE, MODULE)]);
        let cases = [
            (
                "another module",
                layout(&[{
                    let (b, d) = tar_gz(&[(COMPAT_FILE, b"\0asm\x01\0\0\0 other")]);
                    (COMPAT_LAYER, b, d)
                }]),
                "is not target/idemgate.wasm",
            ),
            (
                "the module under another name",
                layout(&[{
                    let (b, d) = tar_gz(&[("idemgate.wasm", MODULE)]);
                    (COMPAT_LAYER, b, d)
                }]),
                "the layer holds idemgate.wasm",
            ),
            (
                "a raw-module layer",
                layout(&[(
                    "application/vnd.module.wasm.content.layer.v1+wasm",
                    MODULE.to_vec(),
                    String::new(),
                )]),
                "layer media type",
            ),
            (
                "two layers",
                layout(&[
                    (COMPAT_LAYER, blob.clone(), diff_id.clone()),
                    (COMPAT_LAYER, blob.clone(), diff_id.clone()),
                ]),
                "2 layers, not one",
            ),
            (
                "a wrong diff_id",
                layout(&[(COMPAT_LAYER, blob, format!("sha256:{}", "0".repeat(64)))]),
                "diff_ids",
            ),
        ];
        for (what, dir, expected) in cases {
            let err = check(&dir).expect_err(what).to_string();
            assert!(err.contains(expected), "{what}: {err}");
        }
    }

    #[test]
    fn the_image_user_must_be_numeric_and_not_root() {
        assert_eq!(numeric_user("65532:65532").unwrap(), (65532, 65532));
        assert_eq!(numeric_user("1000").unwrap(), (1000, 1000));
        assert!(numeric_user("nonroot").is_err());
        assert!(numeric_user("0:0").is_err());
        assert!(numeric_user("65532:0").is_err());
    }
}
