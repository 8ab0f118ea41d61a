"""The operators' CRDs (tests/data/crds: the upstream files, verbatim) as strict JSON schemas: what
``kubectl apply`` would refuse."""

from __future__ import annotations

import functools
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import yaml

if TYPE_CHECKING:
    import jsonschema

CRDS = Path(__file__).parents[1] / "data" / "crds"


@dataclass(frozen=True)
class Pinned:
    """One vendored CRD: where it was read, at which release, and the sha256 of its bytes here."""

    kind: str
    file: str
    repository: str
    tag: str
    commit: str
    path: str
    sha256: str


PINNED = (
    Pinned("TrainJob", "trainer.kubeflow.org_trainjobs.yaml", "kubeflow/trainer", "v2.3.0",
           "658725bdae5c7e3a0854d93ac6ff492e109a22ab", "manifests/base/crds/trainer.kubeflow.org_trainjobs.yaml",
           "a742cafc5b5582640c7e0b7467c024fc237256fbca5ba0a9f0531dfb66d64416"),
    Pinned("PyTorchJob", "kubeflow.org_pytorchjobs.yaml", "kubeflow/training-operator", "v1.9.0",
           "6f74c7f6b2ed6c27aabd82d0a316b23f0646059c", "manifests/base/crds/kubeflow.org_pytorchjobs.yaml",
           "eb80e57a984cdc7ceefaaf3fc561e21b673c30cbb58589f2389528d2b2760d22"),
    Pinned("JobSet", "jobset.x-k8s.io_jobsets.yaml", "kubernetes-sigs/jobset", "v0.9.1",
           "acea4e18c8d01b55023d74946237790105625ed4", "config/components/crd/bases/jobset.x-k8s.io_jobsets.yaml",
           "6307f9c78901dbebea69050e9da71e35e36743348d79235b870e7d263f8b7013"),
)
FILES = {p.kind: p.file for p in PINNED}


# PyYAML's C loader parses the three files (1.9 MB) in about 0.3 s, its pure-Python one in about 3.6 s.
LOADER = getattr(yaml, "CSafeLoader", yaml.SafeLoader)


def strict(schema: Any) -> Any:
    """``schema`` as the API server applies a structural schema with strict field validation (``kubectl apply``'s
    default), in JSON-schema terms: an object that names its properties is closed to others (unless it keeps
    unknown fields: a field the API server would prune is an error under strict validation), and an
    ``x-kubernetes-int-or-string`` value with no ``anyOf`` of its own takes an integer or a string (a quantity's
    ``pattern`` then applies to strings only, as in Kubernetes)."""
    if isinstance(schema, list):
        return [strict(v) for v in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: strict(v) for k, v in schema.items()}
    keeps_unknown = out.get("x-kubernetes-preserve-unknown-fields", False)
    if "properties" in out and "additionalProperties" not in out and not keeps_unknown:
        out["additionalProperties"] = False
    if out.get("x-kubernetes-int-or-string") and "anyOf" not in out and "type" not in out:
        out["anyOf"] = [{"type": "integer"}, {"type": "string"}]
    return out


@functools.cache
def crd_validator(kind: str) -> tuple[str, jsonschema.Draft7Validator]:
    """(``group/version``, a validator of the strict schema) of ``kind``'s served version; parsed once a session."""
    import jsonschema

    (doc,) = [d for d in yaml.load_all((CRDS / FILES[kind]).read_bytes(), Loader=LOADER) if d]
    (version,) = [v for v in doc["spec"]["versions"] if v["served"]]
    schema = strict(version["schema"]["openAPIV3Schema"])
    return f"{doc['spec']['group']}/{version['name']}", jsonschema.Draft7Validator(schema)


def duplicates(doc: Any, schema: dict[str, Any], path: str = "") -> list[str]:
    """The API server's check of list types JSON schema cannot say: in an ``x-kubernetes-list-type: map`` no two
    items share their ``x-kubernetes-list-map-keys`` (a key the item leaves out counts with its default), in a
    ``set`` no two items are equal ("Duplicate value")."""
    found = []
    if isinstance(doc, dict):
        named, other = schema.get("properties", {}), schema.get("additionalProperties")
        for key, value in doc.items():
            sub = named.get(key, other if isinstance(other, dict) else None)
            if sub is not None:
                found += duplicates(value, sub, f"{path}/{key}")
    elif isinstance(doc, list) and "items" in schema:
        items, list_type = schema["items"], schema.get("x-kubernetes-list-type")
        seen: set[str] = set()
        for i, item in enumerate(doc):
            if list_type == "map":
                fields = items.get("properties", {})
                identity = repr([item.get(k, fields.get(k, {}).get("default")) for k in
                                 schema["x-kubernetes-list-map-keys"]])
            else:
                identity = repr(item)
            if list_type in ("map", "set") and identity in seen:
                found.append(f"{path}/{i}: Duplicate value: {identity}")
            seen.add(identity)
            found += duplicates(item, items, f"{path}/{i}")
    return found


def schema_errors(manifest: dict[str, Any]) -> list[str]:
    """Every way ``manifest`` breaks its kind's CRD schema (empty when it is valid)."""
    api_version, validator = crd_validator(manifest["kind"])
    errors = [] if manifest["apiVersion"] == api_version else [f"apiVersion {manifest['apiVersion']} != {api_version}"]
    errors += [f"{'/'.join(map(str, e.absolute_path))}: {e.message}" for e in validator.iter_errors(manifest)]
    return errors + duplicates(manifest, validator.schema)
