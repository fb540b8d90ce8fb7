"""A stand-in for the Prometheus Operator's PrometheusRule CRD (monitoring.coreos.com/v1).

No package that this project's machines can install ships the operator's CRDs (Debian has no
prometheus-operator package; PyPI's cloudcoil-models-prometheus-operator holds Python models
and npm's @kubernetes-models/prometheus-operator compiled validators, neither the CRD), so the
tests carry this one. It reproduces the upstream schema, descriptions left out, of the fields ctxlaunch
writes, as the operator's `example/prometheus-operator-crd/monitoring.coreos.com_prometheusrules.yaml`
(operator 0.82.2, controller-gen 0.17.3) has them: `spec.groups[]` a list map keyed by `name`
(required, at least one character) with `interval` (a Prometheus duration) and `rules[]`, each
rule with `alert` or `record`, `expr` (required, int-or-string), `for` (a duration), `labels`
and `annotations` (string maps). Upstream fields ctxlaunch does not write (a group's labels,
limit, partial_response_strategy and query_offset, a rule's keep_firing_for) are left out, so a
strict validator refuses them too.
"""

from __future__ import annotations

from typing import Any

from tests.helpers.crd import strict_json_schema

DURATION = (
    r"^(0|(([0-9]+)y)?(([0-9]+)w)?(([0-9]+)d)?(([0-9]+)h)?(([0-9]+)m)?(([0-9]+)s)?(([0-9]+)ms)?)$"
)
"""The operator's pattern for a Prometheus duration (interval, for)."""

_STRING_MAP = {"type": "object", "additionalProperties": {"type": "string"}}

PROMETHEUSRULE_CRD: dict[str, Any] = {
    "apiVersion": "apiextensions.k8s.io/v1",
    "kind": "CustomResourceDefinition",
    "metadata": {"name": "prometheusrules.monitoring.coreos.com"},
    "spec": {
        "group": "monitoring.coreos.com",
        "scope": "Namespaced",
        "names": {
            "kind": "PrometheusRule",
            "listKind": "PrometheusRuleList",
            "plural": "prometheusrules",
            "singular": "prometheusrule",
            "shortNames": ["promrule"],
            "categories": ["prometheus-operator"],
        },
        "versions": [
            {
                "name": "v1",
                "served": True,
                "storage": True,
                "schema": {
                    "openAPIV3Schema": {
                        "type": "object",
                        "required": ["spec"],
                        "properties": {
                            "apiVersion": {"type": "string"},
                            "kind": {"type": "string"},
                            "metadata": {"type": "object"},
                            "spec": {
                                "type": "object",
                                "properties": {
                                    "groups": {
                                        "type": "array",
                                        "x-kubernetes-list-type": "map",
                                        "x-kubernetes-list-map-keys": ["name"],
                                        "items": {
                                            "type": "object",
                                            "required": ["name"],
                                            "properties": {
                                                "name": {"type": "string", "minLength": 1},
                                                "interval": {"type": "string", "pattern": DURATION},
                                                "rules": {
                                                    "type": "array",
                                                    "items": {
                                                        "type": "object",
                                                        "required": ["expr"],
                                                        "properties": {
                                                            "alert": {"type": "string"},
                                                            "record": {"type": "string"},
                                                            "expr": {
                                                                "anyOf": [
                                                                    {"type": "integer"},
                                                                    {"type": "string"},
                                                                ],
                                                                "x-kubernetes-int-or-string": True,
                                                            },
                                                            "for": {
                                                                "type": "string",
                                                                "pattern": DURATION,
                                                            },
                                                            "labels": _STRING_MAP,
                                                            "annotations": _STRING_MAP,
                                                        },
                                                    },
                                                },
                                            },
                                        },
                                    }
                                },
                            },
                        },
                    }
                },
            }
        ],
    },
}


def prometheusrule_schema() -> dict[str, Any]:
    """The stand-in's schema as a JSON Schema that refuses unknown fields (tests/helpers/crd)."""
    (version,) = PROMETHEUSRULE_CRD["spec"]["versions"]
    return strict_json_schema(version["schema"]["openAPIV3Schema"])
