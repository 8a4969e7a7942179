"""The JSON schemas `verl-npu k8s validate` checks manifests against (README.md here says where they come from).

- Kubernetes' own objects (ConfigMap, Pod, and every pod template inside a RayJob or a Volcano Job):
  the strict schemas of Kubernetes KUBERNETES_VERSION, as the kubernetes-validate package (a dev
  dependency, pinned in pyproject.toml) ships them, with the few value rules of CORE_ENUMS and
  QUANTITY_PATTERN added at load time.
- The custom resources: RayJob and the Volcano Job, described by the schema files in this
  directory, written for verl-npu; their pod templates refer to Kubernetes' PodTemplateSpec.
"""

from __future__ import annotations

import functools
import json
from importlib import resources
from typing import Any

# The Kubernetes API the core objects are checked against: the strict schema rejects a field this
# release does not have, so a manifest that validates also works on the newer clusters.
KUBERNETES_VERSION = "1.33"
# The kubernetes-validate release pinned in pyproject.toml's dev extras (tests_npu/k8s/test_k8s_render.py
# keeps the two equal and checks it is the one installed).
KUBERNETES_VALIDATE_VERSION = "1.37.0"
DEFINITIONS_URI = "https://kubernetes.io/api/_definitions.json"  # the $id of kubernetes-validate's definitions
POD_TEMPLATE_REF = f"{DEFINITIONS_URI}#/$defs/io.k8s.api.core.v1.PodTemplateSpec"

CRD_SCHEMAS = {
    ("ray.io/v1", "RayJob"): "rayjob.ray.io-v1.schema.json",
    ("batch.volcano.sh/v1alpha1", "Job"): "job.batch.volcano.sh-v1alpha1.schema.json",
}
CORE_KINDS = {("v1", "Pod"): "io.k8s.api.core.v1.Pod", ("v1", "ConfigMap"): "io.k8s.api.core.v1.ConfigMap"}

# Values the Kubernetes reference documents as a closed set but its OpenAPI schema types only as a
# string (README.md: "What we add"). None stays allowed: an explicit null leaves the field unset.
CORE_ENUMS: dict[tuple[str, str], tuple[str, ...]] = {
    ("io.k8s.api.core.v1.Container", "imagePullPolicy"): ("Always", "IfNotPresent", "Never"),
    ("io.k8s.api.core.v1.EphemeralContainer", "imagePullPolicy"): ("Always", "IfNotPresent", "Never"),
    ("io.k8s.api.core.v1.PodSpec", "restartPolicy"): ("Always", "OnFailure", "Never"),
    ("io.k8s.api.core.v1.ContainerPort", "protocol"): ("TCP", "UDP", "SCTP"),
}
# A quantity (resources, emptyDir sizeLimit, ...): a signed decimal number with an optional binary
# (Ki..Ei) or decimal (n, u, m, k, M..E) suffix or a decimal exponent; the OpenAPI schema accepts any
# string. JSON numbers stay allowed.
QUANTITY = "io.k8s.apimachinery.pkg.api.resource.Quantity"
QUANTITY_PATTERN = r"^[+-]?([0-9]+(\.[0-9]*)?|\.[0-9]+)([KMGTPE]i|[numkMGTPE]|[eE][+-]?[0-9]+)?$"


class SchemaUnavailable(RuntimeError):
    """The Kubernetes schemas cannot be loaded (kubernetes-validate missing or without the release)."""


def crd_schema(file_name: str) -> dict[str, Any]:
    """One of our schema files, read from the installed package."""
    return json.loads(resources.files(__name__).joinpath(file_name).read_text(encoding="utf-8"))


def kubernetes_validate_version() -> str | None:
    from importlib import metadata

    try:
        return metadata.version("kubernetes-validate")
    except metadata.PackageNotFoundError:
        return None


@functools.cache
def core_definitions() -> dict[str, Any]:
    """kubernetes-validate's strict definitions of Kubernetes KUBERNETES_VERSION, with our value rules."""
    folder = f"v{KUBERNETES_VERSION}.0-local-strict"
    fix = (
        f"install the dev extras (bash install.sh --dev, or pip install 'kubernetes-validate=="
        f"{KUBERNETES_VALIDATE_VERSION}')"
    )
    try:
        root = resources.files("kubernetes_validate")
    except ModuleNotFoundError:
        raise SchemaUnavailable(f"the Kubernetes schemas come from the kubernetes-validate package: {fix}") from None
    path = root.joinpath("kubernetes-json-schema", folder, "_definitions.json")
    try:
        document = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise SchemaUnavailable(
            f"kubernetes-validate {kubernetes_validate_version()} has no readable {folder} schemas ({exc}): {fix}"
        ) from None
    definitions = document["$defs"]
    for (name, field), values in CORE_ENUMS.items():
        definitions[name]["properties"][field]["enum"] = [*values, None]
    definitions[QUANTITY] = {"type": ["string", "number"], "pattern": QUANTITY_PATTERN}
    return document


@functools.cache
def registry():
    """A referencing registry holding the Kubernetes definitions (under DEFINITIONS_URI)."""
    from referencing import Registry, Resource

    definitions = core_definitions()
    if definitions.get("$id") != DEFINITIONS_URI:
        raise SchemaUnavailable(f"the Kubernetes definitions are published as {definitions.get('$id')!r}")
    return Resource.from_contents(definitions) @ Registry()


def document_schema(api_version: str, kind: str) -> dict[str, Any]:
    """The schema of a whole document of this kind (KeyError for one we have none for)."""
    if (api_version, kind) in CRD_SCHEMAS:
        return crd_schema(CRD_SCHEMAS[api_version, kind])
    definition = CORE_KINDS[api_version, kind]
    required = ["metadata", "spec"] if kind == "Pod" else ["metadata"]
    return {
        "$schema": "https://json-schema.org/draft/2020-12/schema",
        "$ref": f"{DEFINITIONS_URI}#/$defs/{definition}",
        "required": required,
    }
