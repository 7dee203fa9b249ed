//! The idemgate lock sidecar (work in progress: see the sidecar issue).
