//! The idemgate demo: the scenarios that show duplicate calls breaking the demo backend
//! ([`scenarios`]; the backend itself is `idemgate_rig::backend`), played by the
//! `idemgate-demo` binary (`cargo xtask demo`) on the rig's processes, and by the end-to-end
//! tests through live gateways.

pub mod scenarios;
