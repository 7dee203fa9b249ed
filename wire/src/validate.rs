//! Field limits both ends enforce: the filter before sending, the sidecar on receipt.
//! Sharing them means a request the filter builds is never refused for its shape.

use crate::{
    AbortRequest, ClaimRequest, CompleteRequest, LeaveRequest, RenewRequest, StoredResponse,
};

/// Size limits of protocol fields. `Default` is what the filter assumes and what the
/// sidecar enforces unless configured otherwise (only `max_body` is configurable there).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Limits {
    /// Keys and fingerprints are hex SHA-256 digests (64 chars) in practice.
    pub max_key_len: usize,
    pub max_fingerprint_len: usize,
    pub max_owner_len: usize,
    /// Stored response headers: count and total bytes of names and values.
    pub max_headers: usize,
    pub max_header_bytes: usize,
    /// Stored response body (the frame payload).
    pub max_body: usize,
}

impl Default for Limits {
    fn default() -> Self {
        Limits {
            max_key_len: 128,
            max_fingerprint_len: 128,
            max_owner_len: 64,
            max_headers: 64,
            max_header_bytes: 16 * 1024,
            max_body: 1024 * 1024,
        }
    }
}

/// A field that breaks the protocol's rules: `field` is its JSON name.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FieldError {
    pub field: &'static str,
    pub reason: &'static str,
    /// True when the field is merely too large (HTTP 413 rather than 400).
    pub too_large: bool,
}

impl core::fmt::Display for FieldError {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        write!(f, "{}: {}", self.field, self.reason)
    }
}

impl core::error::Error for FieldError {}

fn invalid(field: &'static str, reason: &'static str) -> FieldError {
    FieldError {
        field,
        reason,
        too_large: false,
    }
}

fn too_large(field: &'static str, reason: &'static str) -> FieldError {
    FieldError {
        field,
        reason,
        too_large: true,
    }
}

/// Keys, fingerprints and owner tokens are visible ASCII without spaces: they become parts
/// of Redis keys and log lines, so nothing that could split or forge either is accepted.
fn token(field: &'static str, value: &str, max: usize) -> Result<(), FieldError> {
    if value.is_empty() {
        return Err(invalid(field, "must not be empty"));
    }
    if value.len() > max {
        return Err(too_large(field, "too long"));
    }
    if !value.bytes().all(|b| b.is_ascii_graphic()) {
        return Err(invalid(field, "must be visible ASCII without spaces"));
    }
    Ok(())
}

fn positive(field: &'static str, value: u64) -> Result<(), FieldError> {
    if value == 0 {
        return Err(invalid(field, "must be greater than zero"));
    }
    Ok(())
}

impl Limits {
    /// A key on its own (the sidecar's admin endpoints take bare keys).
    pub fn key(&self, key: &str) -> Result<(), FieldError> {
        token("key", key, self.max_key_len)
    }

    pub fn claim(&self, req: &ClaimRequest) -> Result<(), FieldError> {
        token("key", &req.key, self.max_key_len)?;
        positive("lease_ms", req.lease_ms)?;
        if let Some(fp) = &req.fingerprint {
            token("fingerprint", fp, self.max_fingerprint_len)?;
        }
        if let Some(wait) = &req.wait {
            positive("wait.budget_ms", wait.budget_ms)?;
        }
        if let Some(waiter) = &req.waiter {
            token("waiter", waiter, self.max_owner_len)?;
        }
        Ok(())
    }

    pub fn leave(&self, req: &LeaveRequest) -> Result<(), FieldError> {
        token("key", &req.key, self.max_key_len)?;
        token("waiter", &req.waiter, self.max_owner_len)
    }

    /// `payload` is the stored body that travels with the request.
    pub fn complete(&self, req: &CompleteRequest, payload: &[u8]) -> Result<(), FieldError> {
        token("key", &req.key, self.max_key_len)?;
        token("owner", &req.owner, self.max_owner_len)?;
        match &req.response {
            Some(resp) => self.stored_response(resp, payload),
            None if !payload.is_empty() => Err(invalid("response", "a body needs a response")),
            None => Ok(()),
        }
    }

    pub fn abort(&self, req: &AbortRequest) -> Result<(), FieldError> {
        token("key", &req.key, self.max_key_len)?;
        token("owner", &req.owner, self.max_owner_len)
    }

    pub fn renew(&self, req: &RenewRequest) -> Result<(), FieldError> {
        token("key", &req.key, self.max_key_len)?;
        token("owner", &req.owner, self.max_owner_len)?;
        positive("lease_ms", req.lease_ms)
    }

    pub fn stored_response(&self, resp: &StoredResponse, body: &[u8]) -> Result<(), FieldError> {
        if !(100..=599).contains(&resp.status) {
            return Err(invalid("response.status", "must be 100..=599"));
        }
        if resp.headers.len() > self.max_headers {
            return Err(too_large("response.headers", "too many headers"));
        }
        let mut bytes = 0usize;
        for (name, value) in &resp.headers {
            if name.is_empty() || !name.bytes().all(is_header_name_byte) {
                return Err(invalid("response.headers", "invalid header name"));
            }
            if value.bytes().any(|b| b == b'\r' || b == b'\n' || b == 0) {
                return Err(invalid("response.headers", "invalid header value"));
            }
            bytes = bytes.saturating_add(name.len() + value.len());
        }
        if bytes > self.max_header_bytes {
            return Err(too_large("response.headers", "headers too large"));
        }
        if body.len() > self.max_body {
            return Err(too_large("body", "stored body too large"));
        }
        Ok(())
    }
}

/// RFC 9110 `token` characters, lower-case only (Envoy lower-cases header names).
fn is_header_name_byte(b: u8) -> bool {
    b.is_ascii_lowercase() || b.is_ascii_digit() || b"!#$%&'*+-.^_`|~".contains(&b)
}
