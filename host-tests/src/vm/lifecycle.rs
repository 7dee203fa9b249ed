//! Module lifecycle: instantiation and export discovery, Envoy's start sequence
//! (`_initialize`, `on_context_create`, `on_vm_start`, `on_configure`), calling exports with a
//! running context (a trap fails the VM), FAIL_RELOAD's re-creation, and root shutdown.

use super::state::{Deferred, Root, Target, VmState};
use super::{StreamId, Vm};
use crate::abi::LogLevel;
use crate::plugin::{Clusters, LoadError, PluginSettings, WasmModule};
use crate::shared::{Mailbox, SharedState};
use std::collections::{BTreeMap, HashMap, VecDeque};
use std::sync::Arc;
use wasmtime::{Memory, Store, TypedFunc, WasmParams, WasmResults};

/// `(root_context_id, token, num_headers, body_size, num_trailers)`.
type CalloutResponseArgs = (i32, i32, i32, i32, i32);
#[derive(Clone)]
pub(crate) struct Exports {
    pub(super) initialize: Option<TypedFunc<(), ()>>,
    pub(super) main_void: Option<TypedFunc<(), i32>>,
    pub(super) main: Option<TypedFunc<(i32, i32), i32>>,
    pub(super) start: Option<TypedFunc<(), ()>>,
    pub(super) context_create: Option<TypedFunc<(i32, i32), ()>>,
    pub(super) vm_start: Option<TypedFunc<(i32, i32), i32>>,
    pub(super) configure: Option<TypedFunc<(i32, i32), i32>>,
    pub(super) tick: Option<TypedFunc<i32, ()>>,
    pub(super) queue_ready: Option<TypedFunc<(i32, i32), ()>>,
    pub(super) request_headers: Option<TypedFunc<(i32, i32, i32), i32>>,
    pub(super) request_body: Option<TypedFunc<(i32, i32, i32), i32>>,
    pub(super) request_trailers: Option<TypedFunc<(i32, i32), i32>>,
    pub(super) response_headers: Option<TypedFunc<(i32, i32, i32), i32>>,
    pub(super) response_body: Option<TypedFunc<(i32, i32, i32), i32>>,
    pub(super) response_trailers: Option<TypedFunc<(i32, i32), i32>>,
    pub(super) http_call_response: Option<TypedFunc<CalloutResponseArgs, ()>>,
    pub(super) grpc_receive_initial_metadata: Option<TypedFunc<(i32, i32, i32), ()>>,
    pub(super) grpc_receive: Option<TypedFunc<(i32, i32, i32), ()>>,
    pub(super) grpc_receive_trailing_metadata: Option<TypedFunc<(i32, i32, i32), ()>>,
    pub(super) grpc_close: Option<TypedFunc<(i32, i32, i32), ()>>,
    pub(super) log: Option<TypedFunc<i32, ()>>,
    pub(super) done: Option<TypedFunc<i32, i32>>,
    pub(super) delete: Option<TypedFunc<i32, ()>>,
}

/// The instantiated module: its memory and allocator (used by hostcalls) and its exports.
pub(crate) struct Wasm {
    pub(crate) memory: Memory,
    pub(crate) alloc: TypedFunc<i32, i32>,
    pub(super) exports: Exports,
}

pub(super) enum Called<R> {
    Returned(R),
    Missing,
    Failed,
}

fn typed<P: WasmParams, R: WasmResults>(
    instance: &wasmtime::Instance,
    store: &mut Store<VmState>,
    name: &str,
) -> Result<Option<TypedFunc<P, R>>, LoadError> {
    match instance.get_func(&mut *store, name) {
        None => Ok(None),
        Some(f) => f
            .typed::<P, R>(&*store)
            .map(Some)
            .map_err(|e| LoadError::Instantiate(format!("export {name}: {e:#}"))),
    }
}

impl Vm {
    /// Instantiates the module and runs Envoy's start sequence: `_initialize` (+`main`),
    /// `on_context_create(R, 0)`, `on_vm_start(R, ..)`, `on_configure(R, ..)`.
    pub fn boot(
        module: &WasmModule,
        plugin: Arc<PluginSettings>,
        clusters: Clusters,
        shared: Arc<SharedState>,
        worker: usize,
    ) -> Result<Self, LoadError> {
        let state = VmState {
            plugin,
            clusters,
            shared,
            mailbox: Arc::new(Mailbox::default()),
            worker,
            module: module.clone(),
            wasm: None,
            generation: 0,
            failed: false,
            last_reload_ns: None,
            restricted: false,
            configuring: false,
            next_context_id: 0,
            root: None,
            streams: BTreeMap::new(),
            touched: Vec::new(),
            context_streams: HashMap::new(),
            next_stream: 0,
            active: None,
            current: Target::None,
            effective: None,
            deferred: VecDeque::new(),
            next_callout_serial: 0,
            callouts: BTreeMap::new(),
            callout_response: None,
            metric_names: HashMap::new(),
            grpc: super::GrpcState::default(),
            next_metric_serial: [0; 3],
        };
        let mut vm = Self {
            store: Store::new(module.pre.module().engine(), state),
        };
        vm.start()?;
        Ok(vm)
    }

    fn start(&mut self) -> Result<(), LoadError> {
        let plugin_name = self.store.data().plugin.name.clone();
        let start_error = |message: String| LoadError::Start {
            plugin: plugin_name.clone(),
            message,
        };
        let pre = self.store.data().module.pre.clone();
        let instance = pre
            .instantiate(&mut self.store)
            .map_err(|e| LoadError::Instantiate(format!("{e:#}")))?;
        let store = &mut self.store;
        let memory = instance
            .get_memory(&mut *store, "memory")
            .ok_or_else(|| LoadError::Instantiate("no exported memory".into()))?;
        let alloc = match typed::<i32, i32>(&instance, store, "malloc")? {
            Some(f) => f,
            None => typed::<i32, i32>(&instance, store, "proxy_on_memory_allocate")?
                .ok_or_else(|| LoadError::Instantiate("no allocator export".into()))?,
        };
        let exports = Exports {
            initialize: typed(&instance, store, "_initialize")?,
            main_void: typed(&instance, store, "__main_void")?,
            main: typed(&instance, store, "main")?,
            start: typed(&instance, store, "_start")?,
            context_create: typed(&instance, store, "proxy_on_context_create")?,
            vm_start: typed(&instance, store, "proxy_on_vm_start")?,
            configure: typed(&instance, store, "proxy_on_configure")?,
            tick: typed(&instance, store, "proxy_on_tick")?,
            queue_ready: typed(&instance, store, "proxy_on_queue_ready")?,
            request_headers: typed(&instance, store, "proxy_on_request_headers")?,
            request_body: typed(&instance, store, "proxy_on_request_body")?,
            request_trailers: typed(&instance, store, "proxy_on_request_trailers")?,
            response_headers: typed(&instance, store, "proxy_on_response_headers")?,
            response_body: typed(&instance, store, "proxy_on_response_body")?,
            response_trailers: typed(&instance, store, "proxy_on_response_trailers")?,
            http_call_response: typed(&instance, store, "proxy_on_http_call_response")?,
            grpc_receive_initial_metadata: typed(
                &instance,
                store,
                "proxy_on_grpc_receive_initial_metadata",
            )?,
            grpc_receive: typed(&instance, store, "proxy_on_grpc_receive")?,
            grpc_receive_trailing_metadata: typed(
                &instance,
                store,
                "proxy_on_grpc_receive_trailing_metadata",
            )?,
            grpc_close: typed(&instance, store, "proxy_on_grpc_close")?,
            log: typed(&instance, store, "proxy_on_log")?,
            done: typed(&instance, store, "proxy_on_done")?,
            delete: typed(&instance, store, "proxy_on_delete")?,
        };
        let state = store.data_mut();
        state.wasm = Some(Wasm {
            memory,
            alloc,
            exports,
        });
        state.failed = false;
        state.root = None;
        state.next_context_id = 0;
        state.next_callout_serial = 0;
        state.next_metric_serial = [0; 3];
        state.metric_names.clear();
        // A new VM (reload) means the old root died: its callouts are cancelled.
        for callout in std::mem::take(&mut state.callouts).into_values() {
            state.shared.end_request(&callout.request.cluster);
        }
        state.context_streams.clear();
        state.grpc.restart();

        state.restricted = true;
        let init = self.call_start_functions();
        self.store.data_mut().restricted = false;
        init.map_err(|e| start_error(format!("_initialize: {e}")))?;

        let root = self.alloc_context_id();
        self.store.data_mut().root = Some(Root {
            id: root,
            tick_period: None,
            next_tick_ns: None,
            status: (0, Vec::new()),
            pending_done: false,
        });
        let (vm_config_len, config_len) = {
            let p = &self.store.data().plugin;
            (
                p.vm_configuration.len() as i32,
                p.configuration.len() as i32,
            )
        };
        let ctx = root as i32;
        self.store.data_mut().configuring = true;
        let created = self.call(
            root,
            "proxy_on_context_create",
            |e| e.context_create.clone(),
            (ctx, 0),
        );
        self.store.data_mut().configuring = false;
        if matches!(created, Called::Failed) {
            return Err(start_error("proxy_on_context_create trapped".into()));
        }
        match self.call(
            root,
            "proxy_on_vm_start",
            |e| e.vm_start.clone(),
            (ctx, vm_config_len),
        ) {
            Called::Failed => return Err(start_error("proxy_on_vm_start trapped".into())),
            Called::Returned(0) => {
                return Err(start_error("proxy_on_vm_start returned false".into()));
            }
            _ => {}
        }
        self.store.data_mut().configuring = true;
        let configured = self.call(
            root,
            "proxy_on_configure",
            |e| e.configure.clone(),
            (ctx, config_len),
        );
        self.store.data_mut().configuring = false;
        match configured {
            Called::Failed => return Err(start_error("proxy_on_configure trapped".into())),
            Called::Returned(0) => {
                return Err(start_error("proxy_on_configure returned false".into()));
            }
            _ => {}
        }
        self.drain();
        Ok(())
    }

    fn call_start_functions(&mut self) -> Result<(), String> {
        let Some(exports) = self.store.data().wasm.as_ref().map(|w| w.exports.clone()) else {
            return Err("not instantiated".into());
        };
        let result = if let Some(init) = exports.initialize {
            init.call(&mut self.store, ()).and_then(|()| {
                if let Some(main) = exports.main_void {
                    main.call(&mut self.store, ()).map(|_| ())
                } else if let Some(main) = exports.main {
                    main.call(&mut self.store, (0, 0)).map(|_| ())
                } else {
                    Ok(())
                }
            })
        } else if let Some(start) = exports.start {
            start.call(&mut self.store, ())
        } else {
            Ok(())
        };
        result.map_err(|e| format!("{e:#}"))
    }

    pub(super) fn alloc_context_id(&mut self) -> u32 {
        let state = self.store.data_mut();
        loop {
            state.next_context_id = state.next_context_id.wrapping_add(1);
            let id = state.next_context_id;
            if id != 0 && !state.is_context(id) {
                return id;
            }
        }
    }

    /// Calls one export with `context` as the running context. A trap marks the VM failed.
    pub(super) fn call<P: WasmParams, R: WasmResults>(
        &mut self,
        context: u32,
        name: &str,
        pick: impl Fn(&Exports) -> Option<TypedFunc<P, R>>,
        params: P,
    ) -> Called<R> {
        let target = self.store.data().resolve(context);
        self.call_as(target, context, name, pick, params)
    }

    /// [`Vm::call`] for the context of stream `id`, which the caller holds: Envoy calls into
    /// the VM through the stream's context object, so nothing is looked up.
    pub(super) fn call_stream<P: WasmParams, R: WasmResults>(
        &mut self,
        id: StreamId,
        context: u32,
        name: &str,
        pick: impl Fn(&Exports) -> Option<TypedFunc<P, R>>,
        params: P,
    ) -> Called<R> {
        self.call_as(Target::Stream(id), context, name, pick, params)
    }

    fn call_as<P: WasmParams, R: WasmResults>(
        &mut self,
        target: Target,
        context: u32,
        name: &str,
        pick: impl Fn(&Exports) -> Option<TypedFunc<P, R>>,
        params: P,
    ) -> Called<R> {
        let state = self.store.data_mut();
        if state.failed {
            return Called::Failed;
        }
        let Some(func) = state.wasm.as_ref().and_then(|w| pick(&w.exports)) else {
            return Called::Missing;
        };
        let saved = (state.active, state.current, state.effective);
        state.active = Some(context);
        state.current = target;
        state.effective = None;
        let result = func.call(&mut self.store, params);
        let state = self.store.data_mut();
        (state.active, state.current, state.effective) = saved;
        match result {
            Ok(r) => Called::Returned(r),
            Err(e) => {
                state.failed = true;
                state.log(
                    LogLevel::Critical,
                    format!("Function: {name} failed: Uncaught RuntimeError: {e:#}"),
                );
                Called::Failed
            }
        }
    }

    /// Fault injection for tests: makes the module trap, as a bug in a plugin would, by
    /// calling `proxy_on_request_headers` for a context it never created (the proxy-wasm
    /// SDKs panic on an unknown context). The VM fails as by any trap ([`Vm::is_failed`]);
    /// a module that survives the call is left as it was.
    pub fn inject_trap(&mut self) {
        let ghost = i32::MAX;
        let _ = self.call(
            ghost as u32,
            "proxy_on_request_headers",
            |e| e.request_headers.clone(),
            (ghost, 0, 0),
        );
    }

    pub(super) fn reload(&mut self) {
        let generation = self.store.data().generation + 1;
        self.store.data_mut().generation = generation;
        let name = self.store.data().plugin.name.clone();
        match self.start() {
            Ok(()) => self.store.data().log(
                LogLevel::Info,
                format!("wasm vm reloaded for plugin {name}"),
            ),
            Err(e) => {
                let state = self.store.data_mut();
                state.failed = true;
                state.log(LogLevel::Error, format!("wasm vm reload failed: {e}"));
            }
        }
    }

    /// Shuts the root down: `on_done(R)`, then `on_delete(R)` now or after `proxy_done`.
    pub fn shutdown(&mut self) {
        let Some(root) = self.root_context_id() else {
            return;
        };
        match self.call(root, "proxy_on_done", |e| e.done.clone(), root as i32) {
            Called::Returned(0) => {
                if let Some(r) = self.store.data_mut().root.as_mut() {
                    r.pending_done = true;
                }
            }
            _ => {
                self.store
                    .data_mut()
                    .deferred
                    .push_back(Deferred::DeleteRoot);
                self.drain();
            }
        }
    }
}
