//! The Kubernetes bundle as rendered (`kubectl kustomize envoy/kubernetes/overlays/<x>`),
//! run: its plugin configuration and its token wiring — Secret -> the gateway's environment
//! -> the filter's VM (`sidecar.token_env`), and Secret -> the sidecar's
//! IDEMGATE_AUTH_TOKEN — through the harness gateway (`target/idemgate.wasm` on the
//! project's proxy-wasm host) against a real sidecar that requires the token, over a real
//! Redis. Then the operator tool against the same stack: `idemgate key` finds the call,
//! `inspect` / `list` / `release` read it over the admin API with the same token.
//!
//! The bundle this replaces answered 503 to every protected request (the sidecar wanted a
//! token no plugin sent); the negative controls below show what that looks like here.

// The whole crate is test code, helpers included: clippy's allow-*-in-tests settings
// (clippy.toml) see only `#[test]` functions and `cfg(test)` items as tests.
#![cfg(test)]

use base64::Engine;
use idemgate_cli::extract;
use idemgate_host::gateway::bootstrap::{Bootstrap, LISTENER};
use idemgate_host::gateway::config::EnvoyConfig;
use idemgate_host::gateway::{Gateway, GatewayOptions};
use idemgate_rig::DemoBackend;
use idemgate_rig::backend::Timings;
use idemgate_rig::sidecar::InProcessSidecar;
use idemgate_sidecar::Config as SidecarConfig;
use idemgate_sidecar::testing::RedisServer;
use serde_json::{Value, json};
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::Command;

fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("..")
}

fn render(overlay: &str) -> String {
    let out = Command::new("kubectl")
        .arg("kustomize")
        .arg(root().join("envoy/kubernetes/overlays").join(overlay))
        .output()
        .expect("kubectl runs (apt install kubectl; cargo xtask test installs it)");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout).unwrap()
}

/// The rendered bundle: its resources, and the values a cluster would resolve.
struct Rendered {
    text: String,
    docs: Vec<Value>,
}

impl Rendered {
    fn of(overlay: &str) -> Rendered {
        let text = render(overlay);
        let docs = serde_norway::Deserializer::from_str(&text)
            .map(|d| <Value as serde::Deserialize>::deserialize(d).unwrap())
            .filter(|d| !d.is_null())
            .collect();
        Rendered { text, docs }
    }

    fn kind(&self, kind: &str) -> impl Iterator<Item = &Value> {
        self.docs.iter().filter(move |d| d["kind"] == kind)
    }

    /// What a container's environment variable `name` resolves to on a cluster: the Secret
    /// key it references, decoded, as the kubelet would.
    fn env_value(&self, containers: &[&Value], name: &str) -> String {
        let env = containers
            .iter()
            .flat_map(|c| c["env"].as_array().unwrap().iter())
            .find(|e| e["name"] == name)
            .unwrap_or_else(|| panic!("no container sets {name}"));
        let secret_ref = &env["valueFrom"]["secretKeyRef"];
        assert!(
            secret_ref.is_object(),
            "{name} must come from a Secret: {env}"
        );
        let secret = self
            .kind("Secret")
            .find(|s| s["metadata"]["name"] == secret_ref["name"])
            .expect("the referenced Secret is in the bundle");
        let encoded = secret["data"][secret_ref["key"].as_str().unwrap()]
            .as_str()
            .expect("the Secret key");
        String::from_utf8(
            base64::engine::general_purpose::STANDARD
                .decode(encoded)
                .unwrap(),
        )
        .unwrap()
    }

    fn sidecar_token(&self) -> String {
        let deployment = self
            .kind("Deployment")
            .find(|d| d["metadata"]["name"] == "idemgate-sidecar")
            .unwrap();
        let sidecar = deployment["spec"]["template"]["spec"]["containers"]
            .as_array()
            .unwrap()
            .iter()
            .find(|c| c["name"] == "sidecar")
            .unwrap();
        self.env_value(&[sidecar], "IDEMGATE_AUTH_TOKEN")
    }

    /// The gateway's Envoy containers: Istio's injected gateway, or Envoy Gateway's proxy.
    fn gateway_containers(&self) -> Vec<&Value> {
        let istio = self
            .kind("Deployment")
            .filter(|d| d["metadata"]["name"] != "idemgate-sidecar")
            .flat_map(|d| {
                d["spec"]["template"]["spec"]["containers"]
                    .as_array()
                    .unwrap()
            });
        let envoy_gateway = self
            .kind("EnvoyProxy")
            .map(|p| &p["spec"]["provider"]["kubernetes"]["envoyDeployment"]["container"]);
        istio.chain(envoy_gateway).collect()
    }

    /// The one idemgate plugin configuration, checked by the filter's parser as `idemgate
    /// check` does, and the VM variables its platform passes in.
    fn plugin(&self) -> (Value, Vec<String>) {
        let found = extract::configurations(&self.text).unwrap();
        assert_eq!(found.len(), 1, "one idemgate plugin per overlay");
        extract::check(&found[0])
            .unwrap_or_else(|e| panic!("{}", extract::describe_all(&found[0], &e)));
        let json = found[0].json.clone().unwrap();
        (
            serde_json::from_slice(&json).unwrap(),
            found[0].environment.clone().unwrap(),
        )
    }
}

/// A gateway running `plugin` with `environment` as its VM's environment variables (what
/// Envoy builds from `host_env_keys` on a cluster; the harness takes `key_values`), the
/// sidecar cluster named as the plugin names it and pointed at `sidecar`.
fn gateway(
    backend: SocketAddr,
    sidecar: SocketAddr,
    plugin: &Value,
    environment: &[(&str, &str)],
) -> Result<(Gateway, SocketAddr), String> {
    let mut bootstrap = Bootstrap::idemgate(backend, sidecar, &plugin.to_string()).to_value();
    let cluster_name = plugin["sidecar"]["cluster"].as_str().unwrap();
    for cluster in bootstrap["static_resources"]["clusters"]
        .as_array_mut()
        .unwrap()
    {
        if cluster["name"] == "idemgate_sidecar" {
            cluster["name"] = json!(cluster_name);
            cluster["load_assignment"]["cluster_name"] = json!(cluster_name);
        }
    }
    let filter = &mut bootstrap["static_resources"]["listeners"][0]["filter_chains"][0]["filters"]
        [0]["typed_config"]["http_filters"][0]["typed_config"]["config"]["vm_config"];
    let key_values: serde_json::Map<String, Value> = environment
        .iter()
        .map(|(k, v)| ((*k).to_owned(), json!(v)))
        .collect();
    filter["environment_variables"] = json!({ "key_values": key_values });
    let yaml = serde_norway::to_string(&bootstrap).unwrap();
    let config = EnvoyConfig::from_yaml(&yaml, &idemgate_host::target_dir().join(".."))
        .map_err(|e| e.to_string())?;
    let gateway = Gateway::start(
        config,
        GatewayOptions {
            concurrency: 1,
            ..GatewayOptions::default()
        },
    )
    .map_err(|e| e.to_string())?;
    let addr = gateway.listener_address(LISTENER).unwrap();
    Ok((gateway, addr))
}

fn pay(client: &reqwest::blocking::Client, gateway: SocketAddr, key: &str) -> (u16, bool, String) {
    let response = client
        .post(format!("http://{gateway}/payments"))
        .header("idempotency-key", key)
        .header("x-user-id", "u1")
        .header("content-type", "application/json")
        .body(r#"{"amount": 10}"#)
        .send()
        .expect("the gateway answers");
    let replayed = response.headers().contains_key("idempotent-replayed");
    (
        response.status().as_u16(),
        replayed,
        response.text().unwrap(),
    )
}

fn idemgate(args: &[&str], env: &[(&str, &str)]) -> (bool, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_idemgate"))
        .args(args)
        .env_remove("IDEMGATE_AUTH_TOKEN")
        .envs(env.iter().copied())
        .output()
        .unwrap();
    (
        out.status.success(),
        String::from_utf8_lossy(&out.stdout).into_owned() + &String::from_utf8_lossy(&out.stderr),
    )
}

#[test]
fn rendered_overlays_protect_calls_end_to_end_with_the_token_from_one_secret() {
    let backend = DemoBackend::start(Timings::default()).expect("the demo backend starts");
    let backend_addr = backend.addr();
    let redis = RedisServer::start().expect("redis-server starts (apt install redis-server)");
    let client = reqwest::blocking::Client::builder()
        .timeout(std::time::Duration::from_secs(20))
        .build()
        .unwrap();
    let rendered_dir = idemgate_host::target_dir().join("bundle-test");
    std::fs::create_dir_all(&rendered_dir).unwrap();

    for overlay in ["istio", "envoy-gateway"] {
        let bundle = Rendered::of(overlay);
        let sidecar_token = bundle.sidecar_token();
        let (plugin, passed) = bundle.plugin();
        let variable = plugin["sidecar"]["token_env"]
            .as_str()
            .unwrap_or_else(|| panic!("{overlay}: the plugin reads no token (sidecar.token_env)"));
        assert!(
            passed.iter().any(|p| p == variable),
            "{overlay}: {variable} reaches the VM"
        );
        let gateway_token = bundle.env_value(&bundle.gateway_containers(), variable);
        assert_eq!(
            gateway_token, sidecar_token,
            "{overlay}: one Secret for both ends"
        );
        assert!(
            !bundle.text.contains(&sidecar_token)
                || bundle.kind("Secret").count() == 1
                    && !plugin.to_string().contains(&sidecar_token),
            "{overlay}: the token is in no custom resource"
        );

        let sidecar = InProcessSidecar::start(SidecarConfig {
            auth_token: Some(sidecar_token.clone()),
            ..SidecarConfig::loopback(redis.store_config())
        })
        .expect("sidecar starts");
        let sidecar_addr = sidecar.addr();

        let (gw, addr) = gateway(
            backend_addr,
            sidecar_addr,
            &plugin,
            &[(variable, gateway_token.as_str())],
        )
        .unwrap();
        let key = format!("{overlay}-k1");
        let first = pay(&client, addr, &key);
        assert_eq!((first.0, first.1), (201, false), "{overlay}: {first:?}");
        let again = pay(&client, addr, &key);
        assert_eq!((again.0, again.1), (201, true), "{overlay}: {again:?}");
        assert_eq!(
            again.2, first.2,
            "{overlay}: the replay is the stored response"
        );
        let served = gw;

        // Negative controls: the wrong token is the shipped-503 failure; a variable the VM
        // does not get fails the filter's configuration instead of sending no token.
        let (gw, addr) =
            gateway(backend_addr, sidecar_addr, &plugin, &[(variable, "wrong")]).unwrap();
        assert_eq!(
            pay(&client, addr, &format!("{overlay}-k2")).0,
            503,
            "{overlay}: wrong token"
        );
        gw.shutdown();
        match gateway(backend_addr, sidecar_addr, &plugin, &[]) {
            Err(e) => assert!(e.contains("idemgate") || !e.is_empty(), "{e}"),
            Ok((gw, addr)) => {
                let status = pay(&client, addr, &format!("{overlay}-k3")).0;
                assert!(status >= 500, "{overlay}: without the variable: {status}");
                gw.shutdown();
            }
        }

        // The operator tool on the same call.
        let file = rendered_dir.join(format!("{overlay}.yaml"));
        std::fs::write(&file, &bundle.text).unwrap();
        let file = file.to_str().unwrap();
        let (ok, checked) = idemgate(&["check", file], &[]);
        assert!(ok, "{checked}");
        let (ok, stored) = idemgate(
            &[
                "key", "--config", file, "--rule", "payments", "--method", "POST",
            ]
            .into_iter()
            .chain(["--scope", "x-user-id=u1", "--key", &key])
            .collect::<Vec<_>>(),
            &[],
        );
        assert!(ok, "{stored}");
        let stored = stored.trim();
        let url = format!("http://{sidecar_addr}");
        let with_token = [
            ("IDEMGATE_SIDECAR_URL", url.as_str()),
            ("IDEMGATE_AUTH_TOKEN", sidecar_token.as_str()),
        ];
        // The completion reaches the sidecar after the response (a callout of its own).
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
        let inspected = loop {
            let (ok, inspected) = idemgate(&["inspect", stored], &with_token);
            assert!(ok, "{inspected}");
            let inspected: Value = serde_json::from_str(&inspected).unwrap();
            if inspected["state"] == "completed" || std::time::Instant::now() > deadline {
                break inspected;
            }
            std::thread::sleep(std::time::Duration::from_millis(50));
        };
        assert_eq!(inspected["state"], "completed", "{overlay}: {inspected}");
        assert_eq!(
            inspected["completed"]["status"], 201,
            "{overlay}: {inspected}"
        );
        let (ok, denied) = idemgate(&["inspect", stored], &with_token[..1]);
        assert!(
            !ok && denied.contains("401"),
            "{overlay}: no token: {denied}"
        );
        let token_file = rendered_dir.join("token");
        std::fs::write(&token_file, format!("{sidecar_token}\n")).unwrap();
        let (ok, listed) = idemgate(
            &["list", "--token-file", token_file.to_str().unwrap()],
            &with_token[..1],
        );
        assert!(ok, "{listed}");
        let listed: Value = serde_json::from_str(&listed).unwrap();
        assert!(listed["keys"].is_array(), "{listed}");
        let (ok, released) = idemgate(&["release", stored], &with_token);
        assert!(ok, "{released}");
        let released: Value = serde_json::from_str(&released).unwrap();
        assert!(released.get("released").is_some(), "{released}");

        served.shutdown();
        sidecar.shutdown().unwrap();
    }
    let stats = backend.backend().stats();
    assert_eq!(
        (stats.charges, stats.double_charges),
        (2, 0),
        "each payment charged once"
    );
}
