#!/usr/bin/env python3
"""Extract the OpenAPI schema of chosen custom resources from CRD files, for the offline
validation of the rendered Kubernetes bundle (envoy/kubernetes/validate.py).

Each schema is written as `<group>_<version>_<kind>.json`, made strict on the way: an
object that lists its properties and does not keep unknown fields
(`x-kubernetes-preserve-unknown-fields`) gets `additionalProperties: false`, so a misspelt
field fails here as `kubectl apply --validate=strict` fails it on a cluster.

Usage: vendor.py OUT_DIR CRD_FILE... (every CRD of the files whose kind is in KINDS)
Where the vendored files came from is in SOURCES.md next to them.
"""

import json
import sys

import yaml

KINDS = {
    "WasmPlugin",
    "TrafficExtension",
    "RequestAuthentication",
    "EnvoyExtensionPolicy",
    "EnvoyPatchPolicy",
    "EnvoyProxy",
    "SecurityPolicy",
    "ClientTrafficPolicy",
    "AuthorizationPolicy",
    "EnvoyFilter",
    "ServiceMonitor",
}


def strict(node):
    if isinstance(node, dict):
        if (
            node.get("type") == "object"
            and "properties" in node
            and "additionalProperties" not in node
            and not node.get("x-kubernetes-preserve-unknown-fields")
        ):
            node["additionalProperties"] = False
        for value in node.values():
            strict(value)
    elif isinstance(node, list):
        for value in node:
            strict(value)
    return node


def main(out_dir, files):
    for path in files:
        with open(path, encoding="utf-8") as f:
            for crd in yaml.safe_load_all(f):
                if not crd or crd.get("kind") != "CustomResourceDefinition":
                    continue
                spec = crd["spec"]
                kind = spec["names"]["kind"]
                if kind not in KINDS:
                    continue
                for version in spec["versions"]:
                    schema = strict(version["schema"]["openAPIV3Schema"])
                    # metadata is checked by the API server, not by the CRD schema.
                    root = schema.setdefault("properties", {})
                    root["metadata"] = {"type": "object"}
                    root["apiVersion"] = {"type": "string"}
                    root["kind"] = {"type": "string"}
                    name = f"{spec['group']}_{version['name']}_{kind}.json"
                    with open(f"{out_dir}/{name}", "w", encoding="utf-8") as out:
                        json.dump(schema, out, sort_keys=True, separators=(",", ":"))
                        out.write("\n")
                    print(name)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:])
