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


def problems(docs):
    found = [p for d in docs for p in schema_problems(d)]
    return found + wiring_problems(docs) + pinning_problems(docs)


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
            for (description, broken), check in checked:
                if check(broken):
                    print(f"{path}: rejects {description}")
                else:
                    failed = True
                    print(f"{path}: ACCEPTED {description} (validator too lenient)")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
