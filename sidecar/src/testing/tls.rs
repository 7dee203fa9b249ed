//! A throw-away private CA for tests that reach Redis over TLS (`rediss://`): a server
//! certificate for 127.0.0.1 and a client certificate, made at test time with rcgen. Nothing
//! is read from or written to the machine's trust store.

use super::{RedisCluster, RedisServer, free_port};
use crate::config::RedisTls;
use rcgen::{BasicConstraints, CertificateParams, DnType, IsCa, Issuer, KeyPair};
use std::io;
use std::path::PathBuf;

/// The CA, the server's and the client's certificates and keys, as PEM files in a scratch
/// directory (removed on drop).
pub struct Pki {
    dir: PathBuf,
}

impl Pki {
    /// # Errors
    /// The scratch directory cannot be written, or rcgen fails.
    pub fn create() -> io::Result<Pki> {
        let dir = std::env::temp_dir().join(format!(
            "idemgate-tls-{}-{:?}",
            std::process::id(),
            std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .unwrap_or_default()
                .as_nanos()
        ));
        std::fs::create_dir_all(&dir)?;
        // Distinct subject names: a leaf named like its issuer looks self-signed to OpenSSL.
        let mut ca_params =
            CertificateParams::new(Vec::<String>::new()).map_err(io::Error::other)?;
        ca_params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        ca_params
            .distinguished_name
            .push(DnType::CommonName, "idemgate test CA");
        let ca_key = KeyPair::generate().map_err(io::Error::other)?;
        let ca = ca_params.self_signed(&ca_key).map_err(io::Error::other)?;
        let issuer = Issuer::new(ca_params, ca_key);
        // Named `name`, valid for `name` and `others`.
        let leaf = |name: &str, others: &[&str]| -> Result<(String, String), rcgen::Error> {
            let key = KeyPair::generate()?;
            let names = std::iter::once(name).chain(others.iter().copied());
            let mut params = CertificateParams::new(names.map(str::to_owned).collect::<Vec<_>>())?;
            params.distinguished_name.push(DnType::CommonName, name);
            params.use_authority_key_identifier_extension = true;
            let cert = params.signed_by(&key, &issuer)?;
            Ok((cert.pem(), key.serialize_pem()))
        };
        let (server_cert, server_key) =
            leaf("127.0.0.1", &["localhost"]).map_err(io::Error::other)?;
        let (client_cert, client_key) = leaf("idemgate-sidecar", &[]).map_err(io::Error::other)?;
        for (name, pem) in [
            ("ca.pem", ca.pem()),
            ("server.pem", server_cert),
            ("server.key", server_key),
            ("client.pem", client_cert),
            ("client.key", client_key),
        ] {
            std::fs::write(dir.join(name), pem)?;
        }
        Ok(Pki { dir })
    }

    #[must_use]
    pub fn file(&self, name: &str) -> PathBuf {
        self.dir.join(name)
    }

    #[must_use]
    pub fn path(&self, name: &str) -> String {
        self.file(name).to_string_lossy().into_owned()
    }

    /// A server's TLS settings: `tls-port`, its certificate, and the CA its clients'
    /// certificates must come from (Redis asks for one by default, `tls-auth-clients yes`).
    fn server_args(&self, tls_port: u16) -> Vec<String> {
        vec![
            "--tls-port".into(),
            tls_port.to_string(),
            "--tls-cert-file".into(),
            self.path("server.pem"),
            "--tls-key-file".into(),
            self.path("server.key"),
            "--tls-ca-cert-file".into(),
            self.path("ca.pem"),
        ]
    }

    /// A `redis-server` speaking TLS on `tls_port` (and plain text on its own port).
    ///
    /// # Errors
    /// It does not start.
    pub fn redis_server(&self, tls_port: u16) -> io::Result<RedisServer> {
        let args = self.server_args(tls_port);
        RedisServer::start_with(&args.iter().map(String::as_str).collect::<Vec<_>>())
    }

    /// A three-primary Cluster whose nodes speak TLS to clients and to each other
    /// (`tls-cluster yes`: a TLS client is told the nodes' TLS ports), and plain text on
    /// their own ports for the tests' `redis-cli`. Each node's TLS port:
    /// `CONFIG GET tls-port`.
    ///
    /// # Errors
    /// A node does not start or the cluster does not form.
    pub fn redis_cluster(&self) -> io::Result<RedisCluster> {
        RedisCluster::start_with(|| {
            let mut args = self.server_args(free_port(false)?);
            args.extend(["--tls-cluster".into(), "yes".into()]);
            Ok(args)
        })
    }

    /// What the sidecar is given: the private CA and the client certificate.
    ///
    /// # Errors
    /// The files cannot be read.
    pub fn client_tls(&self) -> io::Result<RedisTls> {
        RedisTls::from_files(
            Some(&self.file("ca.pem")),
            Some((&self.file("client.pem"), &self.file("client.key"))),
        )
        .map_err(io::Error::other)
    }
}

impl Drop for Pki {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// Whether the installed `redis-server` was built with TLS (a build without it refuses
/// the `tls-port` directive itself, before looking at any file).
#[must_use]
pub fn redis_has_tls() -> bool {
    let probe = std::process::Command::new("redis-server")
        .args([
            "--port",
            "0",
            "--tls-port",
            "1",
            "--tls-cert-file",
            "/nonexistent",
        ])
        .output();
    match probe {
        Ok(out) => {
            let text = String::from_utf8_lossy(&out.stdout) + String::from_utf8_lossy(&out.stderr);
            !text.contains("Bad directive")
        }
        Err(_) => false,
    }
}
