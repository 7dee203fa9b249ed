#!/usr/bin/env python3
"""Validate rendered Kubernetes bundles (`kubectl kustomize envoy/kubernetes/overlays/X`)
without a cluster.

- Built-in kinds against the Kubernetes API schemas (PyPI `kubernetes-validate`, strict: an
  unknown field fails), for every version in KUBERNETES_VERSIONS.
- Custom resources (Istio, Envoy Gateway, Prometheus Operator) against the CRD schemas
  vendored in schemas/ (made strict by schemas/vendor.py; sources in schemas/SOURCES.md).
- The sidecar token's wiring, which no schema sees: the sidecar and every gateway read the
  same Secret key; every idemgate plugin config reads the token from the VM environment
  (`sidecar.token_env`) through a variable its gateway passes in (Istio `vmConfig.env` with
  `valueFrom: HOST`, Envoy Gateway `env.hostKeys`); and the token's value appears in no
  resource but the Secret. This is what keeps a bundle that answers 503 to every protected
  request (a sidecar wanting a token no filter sends) from being shipped again.
- Image pinning: every idemgate image (the sidecar's containers, the filter's `url`) is
  referenced by `@sha256:` digest, and a separate `sha256` field is that same digest.
- Observability as envoy/envoy.yaml ships it, which no schema sees either: every gateway
  writes an access log in envoy.yaml's very format (the filter's decision from its filter
  state), extracts the `rule` label with envoy.yaml's very stats tags, and (Istio) keeps the
  filter's stats; the Envoy parts (Istio's connection-manager patch, both bootstraps' stats
  config) parse strictly as Envoy's API (the `xds-protos` messages check_config.py uses).

The idemgate configurations embedded in the bundle are checked by `idemgate check`.

Usage: validate.py RENDERED.yaml...   (exit 1 naming every problem)
       validate.py --self-test RENDERED.yaml   (also prove broken variants are rejected)
"""

import base64
import copy
import json
import os
import re
import sys

import jsonschema
import kubernetes_validate
import yaml

# This file's directory comes off the import path: protobuf's generated code imports a
# `validate` package (protoc-gen-validate), which this very file would shadow.
HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != HERE]
sys.path.insert(0, os.path.join(HERE, ".."))
from google.protobuf import json_format  # noqa: E402

import check_config  # noqa: E402  (envoy/check_config.py: the Envoy API schema)
from envoy.config.bootstrap.v3 import bootstrap_pb2  # noqa: E402
from envoy.extensions.filters.network.http_connection_manager.v3 import (  # noqa: E402
    http_connection_manager_pb2,
)

KUBERNETES_VERSIONS = ["1.27.0", "1.37.0"]
SCHEMAS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "schemas")
TOKEN_ENV_OF_SIDECAR = "IDEMGATE_AUTH_TOKEN"


def crd_schema(doc):
    group, _, version = doc["apiVersion"].rpartition("/")
    path = os.path.join(SCHEMAS, f"{group}_{version}_{doc['kind']}.json")
    if not group or not os.path.exists(path):
        return None
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def schema_problems(doc):
    name = f"{doc.get('kind')}/{doc.get('metadata', {}).get('name')}"
    schema = crd_schema(doc)
    if schema is not None:
        validator = jsonschema.Draft7Validator(schema)
        return [
            f"{name}: {'.'.join(str(p) for p in e.absolute_path) or '(root)'}: {e.message}"
            for e in validator.iter_errors(doc)
        ]
    problems = []
    for version in KUBERNETES_VERSIONS:
        try:
            kubernetes_validate.validate(doc, version, strict=True)
        except kubernetes_validate.SchemaNotFoundError:
            return [f"{name}: no schema for {doc.get('apiVersion')} {doc.get('kind')}"]
        except kubernetes_validate.ValidationError as e:
            path = ".".join(str(p) for p in e.path) or "(root)"
            problems.append(f"{name}: Kubernetes {version}: {path}: {e.message}")
    return problems


def containers(doc):
    spec = doc.get("spec", {})
    if doc.get("kind") in ("Deployment", "StatefulSet", "DaemonSet"):
        pod = spec.get("template", {}).get("spec", {})
        return pod.get("containers", []) + pod.get("initContainers", [])
    if doc.get("kind") == "EnvoyProxy":
        deployment = spec.get("provider", {}).get("kubernetes", {}).get("envoyDeployment", {})
        return [deployment.get("container", {})]
    return []


def secret_refs(doc, variable):
    """(secret, key) of every container env `variable` set from a Secret in `doc`."""
    for container in containers(doc):
        for env in container.get("env", []) or []:
            if env.get("name") == variable:
                ref = (env.get("valueFrom") or {}).get("secretKeyRef")
                yield (ref.get("name"), ref.get("key")) if ref else (None, None)


def plugin_configs(doc):
    """(where, plugin config, variables the gateway passes into the VM from its process)."""
    kind, spec = doc.get("kind"), doc.get("spec", {})
    name = doc.get("metadata", {}).get("name")
    if kind == "WasmPlugin" or kind == "TrafficExtension":
        wasm = spec if kind == "WasmPlugin" else spec.get("wasm", {})
        host = [
            e["name"]
            for e in (wasm.get("vmConfig") or {}).get("env", []) or []
            if e.get("valueFrom") == "HOST"
        ]
        yield f"{kind}/{name}", wasm.get("pluginConfig"), host
    elif kind == "EnvoyExtensionPolicy":
        for i, wasm in enumerate(spec.get("wasm", []) or []):
            host = (wasm.get("env") or {}).get("hostKeys", []) or []
            yield f"{kind}/{name}.wasm[{i}]", wasm.get("config"), host


def wiring_problems(docs):
    problems = []
    secrets = {
        d["metadata"]["name"]: d for d in docs if d.get("kind") == "Secret"
    }
    sidecar_refs = {r for d in docs for r in secret_refs(d, TOKEN_ENV_OF_SIDECAR)}
    if not sidecar_refs:
        return problems  # the sidecar wants no token: nothing to wire
    if len(sidecar_refs) != 1 or None in next(iter(sidecar_refs)):
        return [f"the sidecar's {TOKEN_ENV_OF_SIDECAR} must come from one Secret key, got {sorted(sidecar_refs, key=str)}"]
    (secret, key) = next(iter(sidecar_refs))
    if secret not in secrets:
        problems.append(f"the sidecar's token Secret {secret!r} is not in the bundle")
    token = None
    if secret in secrets:
        data = secrets[secret].get("data", {}) or {}
        if key in data:
            token = base64.b64decode(data[key]).decode()
        else:
            token = (secrets[secret].get("stringData", {}) or {}).get(key)
        if not token:
            problems.append(f"Secret {secret!r} has no key {key!r}")
    found = False
    for doc in docs:
        for where, config, host_keys in plugin_configs(doc):
            found = True
            sidecar = (config or {}).get("sidecar", {}) or {}
            variable = sidecar.get("token_env")
            if variable is None:
                problems.append(
                    f"{where}: the sidecar wants a token but the plugin config has no "
                    "sidecar.token_env (every protected request would get 401 -> 503)"
                )
                continue
            if variable not in host_keys:
                problems.append(
                    f"{where}: sidecar.token_env {variable!r} is not passed into the VM "
                    f"(passed: {host_keys})"
                )
            refs = {r for d in docs for r in secret_refs(d, variable)}
            if refs != {(secret, key)}:
                problems.append(
                    f"{where}: the gateway's {variable} must come from Secret {secret!r} key "
                    f"{key!r} like the sidecar's, got {sorted(refs, key=str) or 'nothing'}"
                )
    if not found:
        problems.append("the bundle has no idemgate plugin for its sidecar")
    if token:
        for doc in docs:
            if doc.get("kind") != "Secret" and token in json.dumps(doc):
                problems.append(
                    f"{doc.get('kind')}/{doc['metadata'].get('name')}: carries the token in plain text"
                )
    return problems


DIGEST = re.compile(r"@sha256:([0-9a-f]{64})$")


def image_refs(doc):
    """(where, reference, separate sha256 field or None) of every idemgate image in `doc`."""
    kind, spec = doc.get("kind"), doc.get("spec", {})
    name = doc.get("metadata", {}).get("name")
    for container in containers(doc):
        if "idemgate" in container.get("image", ""):
            yield f"{kind}/{name} container {container.get('name')}", container["image"], None
    if kind in ("WasmPlugin", "TrafficExtension"):
        wasm = spec if kind == "WasmPlugin" else spec.get("wasm", {})
        yield f"{kind}/{name}", wasm.get("url", ""), wasm.get("sha256")
    elif kind == "EnvoyExtensionPolicy":
        for i, wasm in enumerate(spec.get("wasm", []) or []):
            image = (wasm.get("code") or {}).get("image") or {}
            yield f"{kind}/{name}.wasm[{i}]", image.get("url", ""), image.get("sha256")


def pinning_problems(docs):
    """Every idemgate image is referenced by digest (a tag can be moved under a running
    cluster), and a separate `sha256` field, where given, is that same digest."""
    problems = []
    for doc in docs:
        for where, reference, checksum in image_refs(doc):
            match = DIGEST.search(reference)
            if not match:
                problems.append(f"{where}: image {reference!r} is not pinned by @sha256: digest")
            elif checksum is not None and checksum != match.group(1):
                problems.append(f"{where}: sha256 {checksum!r} is not the digest of {reference!r}")
    return problems


ENVOY_YAML = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "envoy.yaml")
STATS_PREFIX = "wasmcustom.idemgate."


def shipped_observability():
    """(access-log format, stats tags) of envoy/envoy.yaml: what every gateway must ship."""
    with open(ENVOY_YAML, encoding="utf-8") as f:
        config = yaml.safe_load(f)
    formats = [
        log["typed_config"]["log_format"]["text_format_source"]["inline_string"]
        for hcm in check_config.listeners_hcms(config)
        for log in hcm.get("access_log", []) or []
    ]
    return formats, config.get("stats_config", {}).get("stats_tags", [])


def envoy_problems(where, message, value):
    """`value` parsed strictly as Envoy's `message` (its `typed_config` Anys resolved)."""
    value = {k: v for k, v in value.items() if k != "@type"}
    for url in check_config.type_urls(value):
        check_config.register(url)
    try:
        json_format.ParseDict(value, message())
    except json_format.ParseError as e:
        return [f"{where}: not Envoy's {message.DESCRIPTOR.full_name}: {e}"]
    return []


def gateway_observability(docs):
    """Per gateway: (where, access-log formats, stats tags, whether the filter's stats are
    kept), and the problems found reading them."""
    found, problems = [], []
    by_kind = lambda kind: [d for d in docs if d.get("kind") == kind]  # noqa: E731
    for proxy in by_kind("EnvoyProxy"):
        where = f"EnvoyProxy/{proxy['metadata']['name']}"
        spec = proxy.get("spec", {})
        formats = []
        for setting in ((spec.get("telemetry") or {}).get("accessLog") or {}).get("settings", []) or []:
            fmt = setting.get("format") or {}
            stdout = any(
                s.get("type") == "File" and (s.get("file") or {}).get("path") == "/dev/stdout"
                for s in setting.get("sinks", []) or []
            )
            if fmt.get("type") == "Text" and stdout:
                formats.append(fmt.get("text"))
        bootstrap = spec.get("bootstrap") or {}
        stats = {}
        if bootstrap.get("type") == "Merge":
            value = yaml.safe_load(bootstrap.get("value") or "") or {}
            problems += envoy_problems(f"{where}: bootstrap", bootstrap_pb2.Bootstrap, value)
            stats = value.get("stats_config") or {}
        # Envoy Gateway keeps every stat unless `telemetry.metrics.matches` narrows them.
        kept = not ((spec.get("telemetry") or {}).get("metrics") or {}).get("matches")
        found.append((where, formats, stats.get("stats_tags", []), kept))
    plugins = by_kind("WasmPlugin") + by_kind("TrafficExtension")
    for gateway in by_kind("Deployment"):
        template = gateway["spec"]["template"]
        annotations = template.get("metadata", {}).get("annotations", {}) or {}
        if annotations.get("inject.istio.io/templates") != "gateway":
            continue
        where = f"Deployment/{gateway['metadata']['name']}"
        labels = template.get("metadata", {}).get("labels", {}) or {}
        selects = lambda selector: selector and all(  # noqa: E731
            labels.get(k) == v for k, v in selector.items()
        )
        formats = []
        for envoy_filter in by_kind("EnvoyFilter"):
            spec = envoy_filter.get("spec", {})
            if not selects((spec.get("workloadSelector") or {}).get("labels")):
                continue
            for i, patch in enumerate(spec.get("configPatches", []) or []):
                typed = ((patch.get("patch") or {}).get("value") or {}).get("typed_config") or {}
                if patch.get("applyTo") != "NETWORK_FILTER" or typed.get("@type") != check_config.HCM_TYPE:
                    continue
                problems += envoy_problems(
                    f"EnvoyFilter/{envoy_filter['metadata']['name']}.configPatches[{i}]",
                    http_connection_manager_pb2.HttpConnectionManager,
                    typed,
                )
                for log in typed.get("access_log", []) or []:
                    text = (
                        ((log.get("typed_config") or {}).get("log_format") or {})
                        .get("text_format_source", {})
                        .get("inline_string")
                    )
                    formats.append(text)
        stats = {}
        override = annotations.get("sidecar.istio.io/bootstrapOverride")
        maps = [c for c in by_kind("ConfigMap") if c["metadata"]["name"] == override]
        if override and not maps:
            problems.append(f"{where}: bootstrapOverride names ConfigMap {override!r}, not in the bundle")
        for config_map in maps:
            value = json.loads((config_map.get("data") or {}).get("custom_bootstrap.json") or "{}")
            problems += envoy_problems(f"ConfigMap/{override}: custom_bootstrap.json", bootstrap_pb2.Bootstrap, value)
            stats = value.get("stats_config") or {}
        proxy_config = yaml.safe_load(annotations.get("proxy.istio.io/config") or "") or {}
        prefixes = (proxy_config.get("proxyStatsMatcher") or {}).get("inclusionPrefixes", []) or []
        kept = any(STATS_PREFIX.startswith(p) for p in prefixes)
        if not any(selects((p.get("spec", {}).get("selector") or {}).get("matchLabels")) for p in plugins):
            continue  # not a gateway running the filter
        found.append((where, formats, stats.get("stats_tags", []), kept))
    return found, problems


def observability_problems(docs):
    formats, tags = shipped_observability()
    gateways, problems = gateway_observability(docs)
    if not gateways:
        problems.append("the bundle has no gateway running the filter")
    for where, logged, extracted, kept in gateways:
        if not any(f in formats for f in logged):
            problems.append(
                f"{where}: no stdout access log in envoy.yaml's format (the filter's decisions "
                f"from its filter state), got {logged}"
            )
        if extracted != tags:
            problems.append(f"{where}: stats tags {extracted} are not envoy.yaml's {tags}")
        if not kept:
            problems.append(f"{where}: the filter's stats ({STATS_PREFIX}*) are not kept")
    return problems


def problems(docs):
    found = [p for d in docs for p in schema_problems(d)]
    return found + wiring_problems(docs) + pinning_problems(docs) + observability_problems(docs)


def broken_variants(docs):
    def variant(description, mutate):
        broken = copy.deepcopy(docs)
        mutate(broken)
        return description, broken

    def first(kind):
        return lambda ds: next(d for d in ds if d.get("kind") == kind)

    deployment = first("Deployment")
    yield variant(
        "a misspelt Deployment field",
        lambda ds: deployment(ds)["spec"].update(replica=2),
    )

    def plugin(ds):
        for d in ds:
            for _, config, _ in plugin_configs(d):
                return config
        raise AssertionError("no plugin config")

    def crd(ds):
        return next(d for d in ds if crd_schema(d) is not None and "spec" in d)

    yield variant("a misspelt custom resource field", lambda ds: crd(ds)["spec"].update(sepc={}))
    yield variant(
        "a plugin config without token_env (the 503 bundle)",
        lambda ds: plugin(ds)["sidecar"].pop("token_env"),
    )
    yield variant(
        "the token written into the plugin config",
        lambda ds: plugin(ds)["sidecar"].update(
            token=base64.b64decode(first("Secret")(ds)["data"]["token"]).decode()
        ),
    )

    def unpass(ds):
        for d in ds:
            if d.get("kind") == "WasmPlugin":
                d["spec"]["vmConfig"]["env"] = []
            if d.get("kind") == "EnvoyExtensionPolicy":
                d["spec"]["wasm"][0]["env"]["hostKeys"] = []

    yield variant("a token variable the gateway does not pass into the VM", unpass)


def observability_variants(docs):
    """Variants that change only what `observability_problems` reads."""

    def variant(description, mutate):
        broken = copy.deepcopy(docs)
        mutate(broken)
        return description, broken

    def each(ds, kind):
        return [d for d in ds if d.get("kind") == kind]

    def no_access_log(ds):
        for d in each(ds, "EnvoyProxy"):
            d["spec"]["telemetry"]["accessLog"]["settings"] = []
        for d in each(ds, "EnvoyFilter"):
            for patch in d["spec"]["configPatches"]:
                patch["patch"]["value"]["typed_config"].pop("access_log", None)

    def other_format(ds):
        drop = lambda text: text.replace(" decision=%FILTER_STATE(wasm.idemgate.decision:PLAIN)%", "")  # noqa: E731
        for d in each(ds, "EnvoyProxy"):
            fmt = d["spec"]["telemetry"]["accessLog"]["settings"][0]["format"]
            fmt["text"] = drop(fmt["text"])
        for d in each(ds, "EnvoyFilter"):
            for patch in d["spec"]["configPatches"]:
                for log in patch["patch"]["value"]["typed_config"].get("access_log", []):
                    source = log["typed_config"]["log_format"]["text_format_source"]
                    source["inline_string"] = drop(source["inline_string"])

    def no_stats_tags(ds):
        for d in each(ds, "EnvoyProxy"):
            d["spec"].pop("bootstrap")
        for d in each(ds, "Deployment"):
            d["spec"]["template"]["metadata"].get("annotations", {}).pop("sidecar.istio.io/bootstrapOverride", None)

    def unknown_envoy_field(ds):
        # Beside what the other checks compare: only the strict parse can see these.
        for d in each(ds, "EnvoyProxy"):
            d["spec"]["bootstrap"]["value"] += "stats_flush_intervall: 5s\n"
        for d in each(ds, "EnvoyFilter"):
            for patch in d["spec"]["configPatches"]:
                for log in patch["patch"]["value"]["typed_config"].get("access_log", []):
                    log["typed_config"]["path"] = "/dev/stdout"

    yield variant("a gateway without the access log", no_access_log)
    yield variant("an access log without the decision", other_format)
    yield variant("a gateway without the rule stats tag", no_stats_tags)
    yield variant("an unknown Envoy field in the bootstrap or the access log", unknown_envoy_field)
    if any(d.get("kind") == "Deployment" and "proxy.istio.io/config" in d["spec"]["template"]["metadata"].get("annotations", {}) for d in docs):
        yield variant(
            "an Istio gateway that drops the filter's stats",
            lambda ds: [
                d["spec"]["template"]["metadata"]["annotations"].pop("proxy.istio.io/config", None)
                for d in each(ds, "Deployment")
                if "annotations" in d["spec"]["template"]["metadata"]
            ],
        )


def pinning_variants(docs):
    """Variants that change only image references: checked by `pinning_problems` alone,
    which keeps the self-test from validating every schema twice more."""

    def variant(description, mutate):
        broken = copy.deepcopy(docs)
        mutate(broken)
        return description, broken

    def by_tag(ds):
        for d in ds:
            if d.get("kind") == "WasmPlugin":
                d["spec"]["url"] = "oci://ghcr.io/your-org/idemgate-filter:0.1.0"
            if d.get("kind") == "EnvoyExtensionPolicy":
                d["spec"]["wasm"][0]["code"]["image"]["url"] = "ghcr.io/your-org/idemgate-filter:0.1.0"

    def sidecar_by_tag(ds):
        deployment = next(d for d in ds if d.get("kind") == "Deployment")
        deployment["spec"]["template"]["spec"]["containers"][0]["image"] = (
            "ghcr.io/your-org/idemgate-sidecar:0.1.0"
        )

    yield variant("the filter image by tag instead of digest", by_tag)
    yield variant("the sidecar image by tag instead of digest", sidecar_by_tag)


def main(argv):
    self_test = "--self-test" in argv
    files = [a for a in argv if a != "--self-test"]
    if not files:
        print(__doc__, file=sys.stderr)
        return 2
    failed = False
    for path in files:
        with open(path, encoding="utf-8") as f:
            docs = [d for d in yaml.safe_load_all(f) if d]
        found = problems(docs)
        for problem in found:
            print(f"{path}: {problem}")
        if found:
            failed = True
            continue
        print(f"{path}: {len(docs)} resources valid, token wired")
        if self_test:
            checked = [(v, problems) for v in broken_variants(docs)]
            checked += [(v, pinning_problems) for v in pinning_variants(docs)]
            checked += [(v, observability_problems) for v in observability_variants(docs)]
            for (description, broken), check in checked:
                if check(broken):
                    print(f"{path}: rejects {description}")
                else:
                    failed = True
                    print(f"{path}: ACCEPTED {description} (validator too lenient)")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
