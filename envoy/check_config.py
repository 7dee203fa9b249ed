#!/usr/bin/env python3
"""Validate Envoy bootstrap configs against Envoy's API schema, without Envoy.

Envoy cannot run on the project's build machines, so `envoy --mode validate` is not
available. This checks what it would check first: every field name and type against the
data-plane API (PyPI's `xds-protos`, generated from envoyproxy/data-plane-api), including
fields nested inside `typed_config` Any messages, by parsing the YAML into
`envoy.config.bootstrap.v3.Bootstrap` with protobuf's strict JSON parser. On top of the
schema it checks references Envoy resolves at load time: every route's cluster and the
idemgate filter's sidecar cluster must be defined; and where jwt_authn writes headers from
claims, that the client's copies are removed first and jwt_authn runs before idemgate.

Usage:
  check_config.py FILE...        validate configs; exit 1 naming the first problem of each
  check_config.py --self-test FILE
                             also prove the validator rejects broken variants of FILE
"""

import copy
import importlib
import json
import pkgutil
import sys

import yaml
from google.protobuf import json_format

from envoy.config.bootstrap.v3 import bootstrap_pb2

HCM_TYPE = (
    "type.googleapis.com/envoy.extensions.filters.network."
    "http_connection_manager.v3.HttpConnectionManager"
)
WASM_TYPE = "type.googleapis.com/envoy.extensions.filters.http.wasm.v3.Wasm"
JWT_TYPE = (
    "type.googleapis.com/envoy.extensions.filters.http.jwt_authn.v3.JwtAuthentication"
)
EARLY_MUTATION_TYPE = (
    "type.googleapis.com/envoy.extensions.http.early_header_mutation."
    "header_mutation.v3.HeaderMutation"
)


def type_urls(node):
    """Every `@type` value anywhere in a parsed YAML document."""
    if isinstance(node, dict):
        if isinstance(node.get("@type"), str):
            yield node["@type"]
        for value in node.values():
            yield from type_urls(value)
    elif isinstance(node, list):
        for value in node:
            yield from type_urls(value)


def register(type_url):
    """Import every generated module of the message's proto package, so that the strict
    parser can resolve the Any. Message names do not map to file names, hence the whole
    package."""
    full_name = type_url.rsplit("/", 1)[-1]
    package = full_name.rsplit(".", 1)[0]
    try:
        module = importlib.import_module(package)
    except ImportError:
        return  # the parser then names the unresolvable type
    for info in pkgutil.iter_modules(module.__path__):
        if info.name.endswith("_pb2"):
            importlib.import_module(f"{package}.{info.name}")


def listeners_hcms(config):
    for listener in config.get("static_resources", {}).get("listeners", []) or []:
        for chain in listener.get("filter_chains", []) or []:
            for network_filter in chain.get("filters", []) or []:
                typed = network_filter.get("typed_config", {}) or {}
                if typed.get("@type") == HCM_TYPE:
                    yield typed


def reference_problems(config):
    """References Envoy resolves when it loads a static config."""
    clusters = {
        c.get("name")
        for c in config.get("static_resources", {}).get("clusters", []) or []
    }
    for hcm in listeners_hcms(config):
        for vhost in hcm.get("route_config", {}).get("virtual_hosts", []) or []:
            for route in vhost.get("routes", []) or []:
                target = (route.get("route") or {}).get("cluster")
                if target is not None and target not in clusters:
                    yield f"route in virtual host {vhost.get('name')!r} names unknown cluster {target!r}"
        for http_filter in hcm.get("http_filters", []) or []:
            typed = http_filter.get("typed_config", {}) or {}
            if typed.get("@type") != WASM_TYPE:
                continue
            plugin = typed.get("config", {})
            value = (plugin.get("configuration") or {}).get("value")
            if not isinstance(value, str):
                continue
            try:
                plugin_config = json.loads(value)
            except json.JSONDecodeError as err:
                yield f"wasm filter {plugin.get('name')!r}: configuration is not JSON: {err}"
                continue
            sidecar = (plugin_config.get("sidecar") or {}).get("cluster")
            if sidecar is not None and sidecar not in clusters:
                yield f"wasm filter {plugin.get('name')!r} calls unknown sidecar cluster {sidecar!r}"


def filter_index(hcm, type_url):
    """Position of the first HTTP filter of that type in the chain, or None."""
    for index, http_filter in enumerate(hcm.get("http_filters", []) or []):
        if (http_filter.get("typed_config") or {}).get("@type") == type_url:
            return index
    return None


def trust_problems(config):
    """Where a connection manager authenticates callers with jwt_authn, the headers it writes
    from claims (scope headers such as x-user-id) must be trustworthy when idemgate reads
    them: the client's own copies removed before any filter runs (early header mutation:
    jwt_authn only writes a header for a verified token, so without the removal a call
    without one keeps what the client sent), and jwt_authn ahead of the idemgate filter."""
    for hcm in listeners_hcms(config):
        jwt = filter_index(hcm, JWT_TYPE)
        if jwt is None:
            continue
        jwt_config = hcm["http_filters"][jwt]["typed_config"]
        written = {
            claim.get("header_name", "").lower()
            for provider in (jwt_config.get("providers") or {}).values()
            for claim in provider.get("claim_to_headers", []) or []
        }
        removed = {
            (mutation.get("remove") or "").lower()
            for extension in hcm.get("early_header_mutation_extensions", []) or []
            if (extension.get("typed_config") or {}).get("@type") == EARLY_MUTATION_TYPE
            for mutation in extension["typed_config"].get("mutations", []) or []
        }
        for header in sorted(written - removed):
            yield (
                f"jwt_authn writes {header!r} from a claim, but the client's own {header!r} "
                "is not removed first (early_header_mutation_extensions)"
            )
        wasm = filter_index(hcm, WASM_TYPE)
        if wasm is not None and wasm < jwt:
            yield "the wasm filter runs before jwt_authn: it would read unverified headers"


def problems(config):
    """The first schema problem, then every reference and trust problem."""
    if not isinstance(config, dict):
        return ["the document is not a mapping"]
    for url in set(type_urls(config)):
        register(url)
    try:
        json_format.ParseDict(config, bootstrap_pb2.Bootstrap())
    except json_format.ParseError as err:
        return [f"schema: {err}"]
    return list(reference_problems(config)) + list(trust_problems(config))


def broken_variants(config):
    """(description, config) pairs the validator must reject."""

    def variant(description, mutate):
        broken = copy.deepcopy(config)
        mutate(broken)
        return description, broken

    def hcm(c):
        return next(listeners_hcms(c))

    def wasm(c):
        return next(
            f["typed_config"]
            for f in hcm(c)["http_filters"]
            if f.get("typed_config", {}).get("@type") == WASM_TYPE
        )

    def first_cluster(c):
        return c["static_resources"]["clusters"][0]

    yield variant("unknown top-level field", lambda c: c.update(admn={}))
    yield variant(
        "wrong type (connect_timeout as a number)",
        lambda c: first_cluster(c).update(connect_timeout=5),
    )
    yield variant(
        "typo inside the HTTP connection manager",
        lambda c: hcm(c).update(stat_prefx="x"),
    )
    yield variant(
        "typo inside the wasm filter config",
        lambda c: wasm(c)["config"]["vm_config"].update(vm_idd="x"),
    )
    if filter_index(hcm(config), JWT_TYPE) is not None:
        yield variant(
            "the client's x-user-id kept (no early header removal)",
            lambda c: hcm(c).pop("early_header_mutation_extensions"),
        )
        yield variant(
            "the idemgate filter ahead of jwt_authn",
            lambda c: hcm(c)["http_filters"].reverse(),
        )
    yield variant(
        "route to a missing cluster",
        lambda c: hcm(c)["route_config"]["virtual_hosts"][0]["routes"][0]["route"].update(
            cluster="no-such-cluster"
        ),
    )


def main(argv):
    self_test = "--self-test" in argv
    files = [a for a in argv if a != "--self-test"]
    if not files:
        print(__doc__, file=sys.stderr)
        return 2
    failed = False
    for path in files:
        with open(path, encoding="utf-8") as f:
            config = yaml.safe_load(f)
        found = problems(config)
        if found:
            failed = True
            for problem in found:
                print(f"{path}: {problem}")
            continue
        print(f"{path}: valid")
        if self_test:
            for description, broken in broken_variants(config):
                if problems(broken):
                    print(f"{path}: rejects {description}")
                else:
                    failed = True
                    print(f"{path}: ACCEPTED {description} (validator too lenient)")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
