//! `idemgate inspect|list|release`: the sidecar's admin API (`/admin/v1/*`, see
//! sidecar/README.md), authenticated with the sidecar's bearer token.

use anyhow::{Context, Result, bail};
use serde_json::{Value, json};
use std::time::Duration;

pub struct Admin {
    base: String,
    token: Option<String>,
    client: reqwest::blocking::Client,
}

impl Admin {
    pub fn new(base: &str, token: Option<String>) -> Result<Admin> {
        Ok(Admin {
            base: base.trim_end_matches('/').to_owned(),
            token,
            client: reqwest::blocking::Client::builder()
                .timeout(Duration::from_secs(10))
                .build()
                .context("HTTP client")?,
        })
    }

    fn send(&self, request: reqwest::blocking::RequestBuilder) -> Result<Value> {
        let request = match &self.token {
            Some(token) => request.bearer_auth(token),
            None => request,
        };
        let response = request.send().context("the sidecar does not answer")?;
        let status = response.status();
        let body = response.text().context("reading the sidecar's answer")?;
        if !status.is_success() {
            bail!("the sidecar answered {status}: {}", body.trim());
        }
        serde_json::from_str(&body).with_context(|| format!("not JSON: {body}"))
    }

    pub fn inspect(&self, key: &str) -> Result<Value> {
        self.send(
            self.client
                .get(format!("{}/admin/v1/keys/{key}", self.base)),
        )
    }

    pub fn list(&self, limit: u32) -> Result<Value> {
        self.send(
            self.client
                .get(format!("{}/admin/v1/keys?limit={limit}", self.base)),
        )
    }

    pub fn release(&self, key: &str) -> Result<Value> {
        self.send(
            self.client
                .post(format!("{}/admin/v1/release", self.base))
                .json(&json!({ "key": key })),
        )
    }
}

/// The token: `IDEMGATE_AUTH_TOKEN` (the variable the sidecar reads), else the file's first
/// line. Never a flag, which would show in the process list.
pub fn token(from_env: Option<String>, file: Option<&std::path::Path>) -> Result<Option<String>> {
    if let Some(token) = from_env.filter(|t| !t.is_empty()) {
        return Ok(Some(token));
    }
    let Some(file) = file else {
        return Ok(None);
    };
    let text = std::fs::read_to_string(file)
        .with_context(|| format!("reading the token file {}", file.display()))?;
    match text.lines().next().map(str::trim) {
        Some(token) if !token.is_empty() => Ok(Some(token.to_owned())),
        _ => bail!("the token file {} is empty", file.display()),
    }
}
