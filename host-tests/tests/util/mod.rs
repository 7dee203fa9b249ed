//! Shared fixture builders for the integration suite.

use idemgate_host::testing::{TestHost, TestVm};

/// "A booted probe plugin": the probe fixture on one VM, with a `sidecar` cluster.
pub fn probe() -> (TestHost, TestVm) {
    probe_with(|b| b)
}

pub fn probe_with(
    configure: impl FnOnce(
        idemgate_host::testing::PluginBuilder,
    ) -> idemgate_host::testing::PluginBuilder,
) -> (TestHost, TestVm) {
    let host = TestHost::new().cluster("sidecar");
    let vm = configure(
        host.fixture("probe")
            .name("probe")
            .vm_id("probe_vm")
            .root_id("probe_root"),
    )
    .boot()
    .unwrap_or_else(|e| panic!("{e}"));
    (host, vm)
}

/// Log lines with `needle`, for order assertions.
pub fn lines(host: &TestHost, needle: &str) -> Vec<String> {
    host.logs_containing(needle)
}
