"""Write CRDs as a Kubernetes 1.20 API server can hold them: `crd_for_1_20.py SRC... DEST`.

Only what 1.20 refuses is taken out, and this says what:
- `x-kubernetes-validations` (CEL rules, Kubernetes 1.25+): the server cannot evaluate them,
  so what they check (immutable fields, one-of choices) goes unchecked on it;
- `default: ""` on string fields: 1.20 reads an empty-string default as null and refuses the
  schema ("must be of type string"); where such a field is a key of a map-type list
  (x-kubernetes-list-map-keys, which needs a default or required), it becomes required
  instead (imagePullSecrets[].name: every real entry names its Secret).
"""

from __future__ import annotations

import sys
from typing import Any

import yaml


def strip(node: Any) -> None:
    if isinstance(node, list):
        for value in node:
            strip(value)
        return
    if not isinstance(node, dict):
        return
    node.pop("x-kubernetes-validations", None)
    items = node.get("items")
    if isinstance(items, dict):
        for key in node.get("x-kubernetes-list-map-keys", []):
            field = items.get("properties", {}).get(key, {})
            if field.get("default") == "":
                del field["default"]
                required = items.setdefault("required", [])
                if key not in required:
                    required.append(key)
    if node.get("type") == "string" and node.get("default") == "":
        del node["default"]
    for value in node.values():
        strip(value)


def main(argv: list[str]) -> int:
    if len(argv) < 2:
        print("usage: crd_for_1_20.py SRC... DEST", file=sys.stderr)
        return 2
    docs = []
    for path in argv[:-1]:
        with open(path, encoding="utf-8") as handle:
            docs += [d for d in yaml.safe_load_all(handle) if d]
    for doc in docs:
        strip(doc)
    with open(argv[-1], "w", encoding="utf-8") as out:
        yaml.safe_dump_all(docs, out, sort_keys=False)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
