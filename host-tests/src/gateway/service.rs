//! Singleton Wasm services: `bootstrap_extensions` entries `envoy.bootstrap.wasm`
//! (`envoy.extensions.wasm.v3.WasmService` with `singleton: true`), run once on a main-thread
//! VM with its own event loop (timers, callouts, gRPC, posted queue events), sharing shared
//! data and shared queues with the workers' VMs of the same `vm_id`.
//!
//! Mirrors envoy `source/extensions/bootstrap/wasm/config.cc` (`WasmServiceExtension`: the
//! service starts after server initialisation, behind a configuration canary) and
//! `source/extensions/common/wasm/wasm.cc` (`PluginConfig`: a singleton gets one VM on the
//! main thread's dispatcher); shared data and queues are keyed by `vm_id` alone
//! (proxy-wasm-cpp-host `src/shared_data.cc`, `src/shared_queue.cc`).

use super::GatewayError;
use super::config::WasmFilter;
use crate::plugin::{Clusters, WasmModule};
use crate::shared::{MAIN_THREAD, SharedState};
use crate::vm::Vm;
use std::cell::RefCell;
use std::rc::Rc;
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::Duration;
use tokio::sync::{Notify, watch};

/// A singleton Wasm service: its plugin, run on the main thread.
#[derive(Debug, Clone)]
pub struct WasmService {
    pub plugin: WasmFilter,
}

/// Boots each service behind a configuration canary (a rejected configuration fails startup)
/// and runs it on its own main-thread event loop until shutdown.
pub(super) fn start(
    services: &[WasmService],
    shared: &Arc<SharedState>,
    clusters: &Clusters,
    shutdown: &watch::Sender<bool>,
) -> Result<Vec<JoinHandle<()>>, GatewayError> {
    let mut threads = Vec::new();
    for (i, service) in services.iter().enumerate() {
        let wasm_error = |source| GatewayError::Wasm {
            listener: format!("bootstrap_extensions[{i}]"),
            source,
        };
        let module = WasmModule::load(&service.plugin.code).map_err(wasm_error)?;
        let settings = Arc::new(service.plugin.settings.clone());
        let boot = |worker| {
            Vm::boot(
                &module,
                Arc::clone(&settings),
                Arc::clone(clusters),
                Arc::clone(shared),
                worker,
            )
            .map_err(wasm_error)
        };
        drop(boot(crate::shared::CANARY_WORKER)?);
        let vm = boot(MAIN_THREAD)?;
        let clusters = Arc::clone(clusters);
        let shutdown = shutdown.subscribe();
        threads.push(
            std::thread::Builder::new()
                .name(format!("wasm-service-{i}"))
                .spawn(move || run(vm, clusters, shutdown))
                .map_err(GatewayError::Runtime)?,
        );
    }
    Ok(threads)
}

/// The service's event loop: ticks and callout/gRPC timeouts when due, posted queue events
/// when woken, callouts and gRPC exchanges over real sockets; `on_done` at shutdown.
fn run(vm: Vm, clusters: Clusters, mut shutdown: watch::Receiver<bool>) {
    let Ok(runtime) = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
    else {
        return;
    };
    let local = tokio::task::LocalSet::new();
    local.block_on(&runtime, async move {
        let service = Rc::new(ServiceLoop {
            vm: RefCell::new(vm),
            clusters,
            pool: crate::client::Pool::default(),
            grpc: Default::default(),
            work: Notify::new(),
        });
        let mailbox = service.vm.borrow().mailbox();
        // Bounded by shutdown; each turn waits for a deadline, a wake-up or shutdown.
        loop {
            let wait = {
                let vm = service.vm.borrow();
                let now = vm.shared().clock().monotonic_ns();
                vm.next_deadline_ns()
                    .map_or(Duration::from_secs(3600), |d| {
                        Duration::from_nanos(d.saturating_sub(now))
                    })
            };
            tokio::select! {
                _ = shutdown.wait_for(|stop| *stop) => break,
                _ = tokio::time::sleep(wait) => {}
                _ = mailbox.wake.notified() => {}
                _ = service.work.notified() => {}
            }
            {
                let mut vm = service.vm.borrow_mut();
                vm.fire_due();
                vm.run_posted();
            }
            Rc::clone(&service).after_vm_call();
        }
        service.vm.borrow_mut().shutdown();
    });
}

struct ServiceLoop {
    vm: RefCell<Vm>,
    clusters: Clusters,
    pool: crate::client::Pool,
    grpc: crate::grpc_upstream::GrpcUpstream,
    /// Wakes the loop to re-plan its deadline after a delivery from a task.
    work: Notify,
}

impl ServiceLoop {
    /// Sends new callouts and carries out gRPC actions; their answers come back into the VM.
    fn after_vm_call(self: Rc<Self>) {
        let callouts = self.vm.borrow_mut().take_new_callouts();
        for request in callouts {
            let this = Rc::clone(&self);
            let cluster = self
                .clusters
                .get(&request.cluster)
                .cloned()
                .unwrap_or_else(|| crate::plugin::Cluster::named(&request.cluster));
            tokio::task::spawn_local(async move {
                let outcome = crate::upstream::send_callout(&this.pool, &cluster, &request).await;
                this.vm.borrow_mut().deliver_callout(request.token, outcome);
                Rc::clone(&this).after_vm_call();
                this.work.notify_one();
            });
        }
        let grpc = self.vm.borrow_mut().take_grpc_actions();
        if !grpc.is_empty() {
            let this = Rc::clone(&self);
            let deliver: crate::grpc_upstream::Deliver = Rc::new(move |token, event| {
                this.vm.borrow_mut().deliver_grpc(token, event);
                Rc::clone(&this).after_vm_call();
                this.work.notify_one();
            });
            self.grpc.carry_out(grpc, &self.clusters, &deliver);
        }
    }
}
