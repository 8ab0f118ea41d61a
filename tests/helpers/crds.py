"""The operators' CRD schemas (tests/data/crds) as strict JSON schemas: what ``kubectl apply`` would refuse."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import yaml

CRDS = Path(__file__).parents[1] / "data" / "crds"
FILES = {"TrainJob": "trainer.kubeflow.org_trainjobs.yaml", "PyTorchJob": "kubeflow.org_pytorchjobs.yaml",
         "JobSet": "jobset.x-k8s.io_jobsets.yaml"}


def strict(schema: Any) -> Any:
    """``schema`` with every object that names its properties closed to others (unless the schema keeps unknown
    fields), as the API server's strict field validation treats a structural schema."""
    if isinstance(schema, dict):
        out = {k: strict(v) for k, v in schema.items()}
        if ("properties" in out and "additionalProperties" not in out
                and not out.get("x-kubernetes-preserve-unknown-fields")):
            out["additionalProperties"] = False
        return out
    if isinstance(schema, list):
        return [strict(v) for v in schema]
    return schema


def crd_schema(kind: str) -> tuple[str, dict[str, Any]]:
    """(``group/version``, the strict schema) of ``kind``'s served version."""
    (doc,) = [d for d in yaml.safe_load_all((CRDS / FILES[kind]).read_text()) if d]
    (version,) = [v for v in doc["spec"]["versions"] if v["served"]]
    return f"{doc['spec']['group']}/{version['name']}", strict(copy.deepcopy(version["schema"]["openAPIV3Schema"]))


def schema_errors(manifest: dict[str, Any]) -> list[str]:
    """Every way ``manifest`` breaks its kind's CRD schema (empty when it is valid)."""
    import jsonschema

    api_version, schema = crd_schema(manifest["kind"])
    errors = [] if manifest["apiVersion"] == api_version else [f"apiVersion {manifest['apiVersion']} != {api_version}"]
    validator = jsonschema.Draft7Validator(schema)
    return errors + [f"{'/'.join(map(str, e.absolute_path))}: {e.message}" for e in validator.iter_errors(manifest)]
