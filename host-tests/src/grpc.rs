//! gRPC as Envoy's async client speaks it to a cluster, in pure functions: naming the service
//! (a serialized `envoy.config.core.v3.GrpcService`, or a plain cluster name), the request
//! headers, the 5-byte length-prefixed message framing, `grpc-timeout`, and the
//! percent-decoding of `grpc-message`.
//!
//! Mirrors envoy `source/extensions/common/wasm/context.cc` (`Context::grpcCall`,
//! `Context::grpcStream`), `source/common/grpc/common.cc` (`Common::prepareHeaders`,
//! `Common::toGrpcTimeout`, `Common::getGrpcMessage`), `source/common/grpc/codec.cc`
//! (`Encoder`, `Decoder`) and `source/common/grpc/async_client_impl.cc`.

use crate::abi::Status;
use crate::headers::HeaderMap;
use crate::plugin::Clusters;
use base64::Engine as _;
use std::time::Duration;

/// The part of `envoy.config.core.v3.GrpcService` the host uses: the `envoy_grpc` target
/// and the service-level `initial_metadata`.
#[derive(Clone, PartialEq, prost::Message)]
struct GrpcService {
    #[prost(message, optional, tag = "1")]
    envoy_grpc: Option<EnvoyGrpc>,
    /// `google_grpc`: kept opaque, only to tell it apart from a missing target.
    #[prost(bytes = "vec", optional, tag = "2")]
    google_grpc: Option<Vec<u8>>,
    #[prost(message, repeated, tag = "5")]
    initial_metadata: Vec<HeaderValue>,
}

#[derive(Clone, PartialEq, prost::Message)]
struct EnvoyGrpc {
    #[prost(string, tag = "1")]
    cluster_name: String,
    #[prost(string, tag = "2")]
    authority: String,
}

/// `envoy.config.core.v3.HeaderValue`.
#[derive(Clone, PartialEq, prost::Message)]
struct HeaderValue {
    #[prost(string, tag = "1")]
    key: String,
    #[prost(string, tag = "2")]
    value: String,
}

/// Where a gRPC call or stream goes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct GrpcTarget {
    pub(crate) cluster: String,
    /// `:authority`: `envoy_grpc.authority`, else the cluster name.
    pub(crate) authority: String,
    /// The service's `initial_metadata`, sent before the plugin's.
    pub(crate) initial_metadata: Vec<(String, String)>,
}

/// Names the upstream as Envoy's `grpcCall`/`grpcStream` do: the bytes are first parsed as a
/// serialized `GrpcService`; if they do not parse they are a cluster name, and an unknown one
/// is `ParseFailure`. A `GrpcService` without `envoy_grpc` (e.g. `google_grpc`, which the
/// host has no client for) or naming an unknown cluster fails the call with
/// `InternalFailure`, as Envoy's async client does when it cannot start the stream.
pub(crate) fn resolve(service: &[u8], clusters: &Clusters) -> Result<GrpcTarget, Status> {
    match <GrpcService as prost::Message>::decode(service) {
        Ok(proto) => {
            let Some(envoy) = proto.envoy_grpc else {
                return Err(Status::InternalFailure);
            };
            if !clusters.contains_key(&envoy.cluster_name) {
                return Err(Status::InternalFailure);
            }
            let authority = if envoy.authority.is_empty() {
                envoy.cluster_name.clone()
            } else {
                envoy.authority
            };
            Ok(GrpcTarget {
                cluster: envoy.cluster_name,
                authority,
                initial_metadata: proto
                    .initial_metadata
                    .into_iter()
                    .map(|h| (h.key, h.value))
                    .collect(),
            })
        }
        Err(_) => {
            let name = String::from_utf8_lossy(service).into_owned();
            if !clusters.contains_key(&name) {
                return Err(Status::ParseFailure);
            }
            Ok(GrpcTarget {
                authority: name.clone(),
                cluster: name,
                initial_metadata: Vec::new(),
            })
        }
    }
}

/// Serializes a `GrpcService` naming `cluster` (what a C++ plugin passes; for tests).
pub fn grpc_service_bytes(cluster: &str, authority: &str) -> Vec<u8> {
    prost::Message::encode_to_vec(&GrpcService {
        envoy_grpc: Some(EnvoyGrpc {
            cluster_name: cluster.to_owned(),
            authority: authority.to_owned(),
        }),
        google_grpc: None,
        initial_metadata: Vec::new(),
    })
}

/// `Common::toGrpcTimeout`: milliseconds while they fit in 8 digits, then seconds, minutes,
/// hours.
pub(crate) fn grpc_timeout(timeout: Duration) -> String {
    const MAX: u128 = 99_999_999;
    let ms = timeout.as_millis();
    if ms <= MAX {
        return format!("{ms}m");
    }
    let seconds = ms / 1000;
    if seconds <= MAX {
        return format!("{seconds}S");
    }
    let minutes = seconds / 60;
    if minutes <= MAX {
        return format!("{minutes}M");
    }
    format!("{}H", (minutes / 60).min(MAX))
}

/// The request headers of a call or stream (`Common::prepareHeaders` and the async client):
/// `POST /<service>/<method>`, `te: trailers`, `content-type: application/grpc`,
/// `grpc-timeout` for calls, then the service's metadata and the plugin's, with binary
/// (`-bin`) values base64-encoded (`Common::base64EscapeBinHeaders`).
pub(crate) fn request_headers(
    target: &GrpcTarget,
    service: &str,
    method: &str,
    timeout: Option<Duration>,
    metadata: &HeaderMap,
) -> HeaderMap {
    let mut headers = HeaderMap::from([
        (":method", "POST".to_owned()),
        (":path", format!("/{service}/{method}")),
        (":authority", target.authority.clone()),
        (":scheme", "http".to_owned()),
        ("te", "trailers".to_owned()),
        ("content-type", "application/grpc".to_owned()),
    ]);
    if let Some(timeout) = timeout {
        headers.add(b"grpc-timeout", grpc_timeout(timeout).as_bytes());
    }
    for (k, v) in &target.initial_metadata {
        headers.add(k.as_bytes(), v.as_bytes());
    }
    for (k, v) in metadata.entries() {
        if k.ends_with(b"-bin") {
            let encoded = base64::engine::general_purpose::STANDARD_NO_PAD.encode(v);
            headers.add(k, encoded.as_bytes());
        } else {
            headers.add(k, v);
        }
    }
    headers
}

/// One gRPC message on the wire: flags 0 (uncompressed), u32 big-endian length, the bytes.
pub(crate) fn frame(message: &[u8]) -> Vec<u8> {
    let mut out = Vec::with_capacity(5 + message.len());
    out.push(0);
    out.extend_from_slice(&(message.len() as u32).to_be_bytes());
    out.extend_from_slice(message);
    out
}

/// Envoy's `Grpc::Decoder`: collects DATA bytes and yields whole messages.
#[derive(Debug, Default)]
pub(crate) struct Deframer {
    pending: Vec<u8>,
}

/// Why a response body could not be deframed (Envoy closes the stream with Internal).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct BadFrame;

/// The largest message the host accepts, as Envoy's default `max_receive_message_length`
/// leaves it unbounded; this guards memory against a hostile length prefix.
const MAX_MESSAGE: usize = 64 << 20;

impl Deframer {
    /// Appends bytes; returns the messages completed by them.
    pub(crate) fn push(&mut self, data: &[u8]) -> Result<Vec<Vec<u8>>, BadFrame> {
        self.pending.extend_from_slice(data);
        let mut messages = Vec::new();
        while let Some(&[flags, l0, l1, l2, l3]) = self.pending.first_chunk::<5>() {
            let length = u32::from_be_bytes([l0, l1, l2, l3]) as usize;
            // Compressed messages (flag bit 0) are not negotiated by the host; other bits
            // are reserved.
            if flags != 0 || length > MAX_MESSAGE {
                return Err(BadFrame);
            }
            let Some(message) = self.pending.get(5..5 + length) else {
                break;
            };
            messages.push(message.to_vec());
            self.pending.drain(..5 + length);
        }
        Ok(messages)
    }
}

/// `Common::getGrpcMessage`: the percent-decoded `grpc-message` (invalid escapes kept).
pub(crate) fn percent_decode(value: &[u8]) -> Vec<u8> {
    let hex = |b: u8| (b as char).to_digit(16).map(|d| d as u8);
    let mut out = Vec::with_capacity(value.len());
    let mut i = 0;
    while let Some(&byte) = value.get(i) {
        if byte == b'%'
            && let (Some(h), Some(l)) = (
                value.get(i + 1).copied().and_then(hex),
                value.get(i + 2).copied().and_then(hex),
            )
        {
            out.push(h << 4 | l);
            i += 3;
            continue;
        }
        out.push(byte);
        i += 1;
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::plugin::Cluster;
    use std::collections::BTreeMap;
    use std::sync::Arc;

    fn clusters() -> Clusters {
        Arc::new(BTreeMap::from([(
            "backend".to_owned(),
            Cluster::named("backend"),
        )]))
    }

    #[test]
    fn a_plain_cluster_name_or_a_grpc_service_names_the_upstream() {
        let names = |t: GrpcTarget| (t.cluster, t.authority);
        assert_eq!(
            resolve(b"backend", &clusters()).map(names),
            Ok(("backend".into(), "backend".into()))
        );
        assert_eq!(resolve(b"nope", &clusters()), Err(Status::ParseFailure));
        assert_eq!(
            resolve(&grpc_service_bytes("backend", "svc.local"), &clusters()).map(names),
            Ok(("backend".into(), "svc.local".into()))
        );
        assert_eq!(
            resolve(&grpc_service_bytes("other", ""), &clusters()),
            Err(Status::InternalFailure)
        );
    }

    #[test]
    fn timeouts_switch_units_as_envoy_does() {
        assert_eq!(grpc_timeout(Duration::ZERO), "0m");
        assert_eq!(grpc_timeout(Duration::from_millis(1500)), "1500m");
        assert_eq!(grpc_timeout(Duration::from_millis(100_000_000)), "100000S");
    }

    #[test]
    fn frames_round_trip_across_split_data_and_bad_flags_are_refused() {
        let mut wire = frame(b"hello");
        wire.extend(frame(b""));
        let (head, tail) = wire.split_at(3);
        let mut deframer = Deframer::default();
        assert_eq!(deframer.push(head), Ok(Vec::new()));
        assert_eq!(deframer.push(tail), Ok(vec![b"hello".to_vec(), Vec::new()]));
        assert!(deframer.pending.is_empty());
        assert_eq!(Deframer::default().push(&[1, 0, 0, 0, 0]), Err(BadFrame));
    }

    #[test]
    fn grpc_messages_are_percent_decoded() {
        assert_eq!(percent_decode(b"a%20b%zz%"), b"a b%zz%".to_vec());
    }
}
