"""Offline validation of the manifests `verl-npu k8s render` writes (and of any edited copy of them).

Each document is checked against its JSON schema (schemas/README.md): a ConfigMap, a Pod and every pod
template against Kubernetes' own strict schemas (from the kubernetes-validate package), a RayJob and
a Volcano Job against the schemas written here for their fields, in which an unknown field is an
error; then against rules of the API server and the operators that a schema does not carry
(images, names, volume references, extended resources, replica bounds). Errors name the document and
the path inside it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from verl_npu.bounded_read import MIB, NotReadable, read_text
from verl_npu.errors import UserError
from verl_npu.k8s import schemas
from verl_npu.k8s.defaults import DEFAULT_MAX_NODES

# KubeRay appends 6 characters to a RayJob's name for its RayCluster, whose services add up to
# "-serve-svc": a RayJob name is a DNS-1035 label of at most 47 characters (KubeRay's
# MaxRayJobNameLength; longer names are refused by the operator, not by the API server).
RAYJOB_NAME_MAX = 47
DNS1035_LABEL = re.compile(r"^[a-z]([-a-z0-9]*[a-z0-9])?$")
DNS1123_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
DNS1123_SUBDOMAIN = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")
LABEL_MAX = 63
SUBDOMAIN_MAX = 253
CONFIGMAP_KEY = re.compile(r"^[-._a-zA-Z0-9]+$")
# Resource names outside the kubernetes.io domain (and not cpu/memory/...) are extended resources:
# the API server requires their requests to equal their limits (they cannot be overcommitted).
_NATIVE_RESOURCE = re.compile(r"^([a-z0-9-]+|([a-z0-9.-]*\.)?kubernetes\.io/.+|hugepages-.+)$")
# A rendered RayJob and its ConfigMap are tens of KiB; the cap stops /dev/zero-sized input before the YAML parser.
MAX_MANIFEST_BYTES = 4 * MIB
# Kubernetes objects nest about 15 levels deep; the YAML composer and the schema validator recurse per level.
MAX_DEPTH = 64


class ManifestError(UserError):
    """A manifest file cannot be read as Kubernetes documents (not YAML, unknown kind), or the schemas
    cannot be loaded: exit 2."""


@dataclasses.dataclass(frozen=True)
class Problem:
    document: str  # "#1 RayJob verl-npu-mn-1-1"
    path: str  # "spec.rayClusterSpec.headGroupSpec.template.spec.containers[0].image"
    message: str

    def __str__(self) -> str:
        return f"{self.document}: {self.path or '(document)'}: {self.message}"


def _format_path(parts: Any) -> str:
    out = ""
    for part in parts:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out


def _message(error: Any) -> str:
    if error.validator == "pattern" and error.validator_value == schemas.QUANTITY_PATTERN:
        return (
            f"{error.instance!r} does not match the format of a Kubernetes quantity (a number with an optional "
            "suffix: 16, 500m, 256Gi, 1e3)"
        )
    return error.message


@functools.cache
def _validator(api_version: str, kind: str):
    from jsonschema import Draft202012Validator

    try:
        return Draft202012Validator(schemas.document_schema(api_version, kind), registry=schemas.registry())
    except schemas.SchemaUnavailable as exc:
        raise ManifestError(str(exc)) from None


SUPPORTED = (*schemas.CRD_SCHEMAS, *schemas.CORE_KINDS)


def _dict(value: Any) -> dict[str, Any]:
    """``value`` if it is a mapping, else an empty one: the schema reports a wrong type, the rules skip it."""
    return value if isinstance(value, dict) else {}


def _list(value: Any) -> list[Any]:
    return value if isinstance(value, list) else []


def _int(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def pod_templates(doc: dict[str, Any]) -> Iterator[tuple[str, dict[str, Any]]]:
    """(path, pod spec) of every pod a document makes."""
    kind, spec = doc.get("kind"), doc.get("spec")
    if not isinstance(spec, dict):
        return
    if kind == "Pod":
        yield "spec", spec
        return
    templates: list[tuple[str, Any]] = []
    if kind == "RayJob":
        cluster = _dict(spec.get("rayClusterSpec"))
        templates.append(
            ("spec.rayClusterSpec.headGroupSpec.template", _dict(cluster.get("headGroupSpec")).get("template"))
        )
        for i, group in enumerate(_list(cluster.get("workerGroupSpecs"))):
            templates.append((f"spec.rayClusterSpec.workerGroupSpecs[{i}].template", _dict(group).get("template")))
        if spec.get("submitterPodTemplate") is not None:
            templates.append(("spec.submitterPodTemplate", spec["submitterPodTemplate"]))
    elif kind == "Job":
        for i, task in enumerate(_list(spec.get("tasks"))):
            templates.append((f"spec.tasks[{i}].template", _dict(task).get("template")))
    for path, template in templates:
        if isinstance(template, dict) and isinstance(template.get("spec"), dict):
            yield f"{path}.spec", template["spec"]


def _name_problems(doc: dict[str, Any]) -> Iterator[tuple[str, str]]:
    kind = doc.get("kind")
    name = _dict(doc.get("metadata")).get("name")
    if not isinstance(name, str) or not name:
        yield "metadata.name", "required: every object needs a name"
        return
    if kind == "RayJob":
        if len(name) > RAYJOB_NAME_MAX or not DNS1035_LABEL.match(name):
            yield (
                "metadata.name",
                (
                    f"{name!r} must be a DNS-1035 label (lowercase letters, digits and '-', starting with a letter) "
                    f"of at most {RAYJOB_NAME_MAX} characters: KubeRay derives the RayCluster and service names from it"
                ),
            )
    elif kind == "Job":
        # Volcano's svc plugin gives each pod the hostname <job>-<task>-<index>, which is a DNS label.
        longest = len(name)
        for task in _list(_dict(doc.get("spec")).get("tasks")):
            if isinstance(task, dict) and _int(task.get("replicas", 1)) is not None:
                last_index = max(task.get("replicas", 1) - 1, 0)
                longest = max(longest, len(f"{name}-{task.get('name', '')}-{last_index}"))
        if not DNS1123_LABEL.match(name) or longest > LABEL_MAX:
            yield (
                "metadata.name",
                (
                    f"{name!r} must be a DNS-1123 label such that every pod hostname <job>-<task>-<index> "
                    f"fits in {LABEL_MAX} characters (longest here: {longest})"
                ),
            )
    elif len(name) > SUBDOMAIN_MAX or not DNS1123_SUBDOMAIN.match(name):
        yield "metadata.name", f"{name!r} must be a DNS-1123 subdomain (lowercase letters, digits, '-' and '.')"
    if kind == "ConfigMap":
        for key in _dict(doc.get("data")):
            if not CONFIGMAP_KEY.match(str(key)):
                yield f"data.{key}", "a ConfigMap key may hold only letters, digits, '-', '_' and '.'"


def _node_pods(doc: dict[str, Any]) -> tuple[str, int] | None:
    """(where, how many) of the node pods a RayJob (its head and every worker replica) or a Volcano Job (every task
    replica, or minAvailable when larger) starts; None for other kinds."""
    spec = _dict(doc.get("spec"))
    if doc.get("kind") == "RayJob":
        total = 1
        for group in _list(_dict(spec.get("rayClusterSpec")).get("workerGroupSpecs")):
            group = _dict(group)
            replicas = max(_int(group.get("replicas")) or 0, _int(group.get("minReplicas")) or 0)
            total += replicas * max(_int(group.get("numOfHosts")) or 1, 1)
        return "spec.rayClusterSpec.workerGroupSpecs", total
    if doc.get("kind") == "Job":
        tasks = [_int(_dict(t).get("replicas", 1)) or 0 for t in _list(spec.get("tasks"))]
        return "spec.tasks", max(sum(tasks), _int(spec.get("minAvailable")) or 0)
    return None


def _size_problems(doc: dict[str, Any], max_nodes: int) -> Iterator[tuple[str, str]]:
    counted = _node_pods(doc)
    if counted is not None and counted[1] > max_nodes:
        where, total = counted
        yield (
            where,
            f"{total} node pods, more than --max-nodes {max_nodes} (each holds a whole node's NPUs; Kubernetes "
            f"supports at most {DEFAULT_MAX_NODES} nodes per cluster): lower the replicas, or pass --max-nodes with "
            "the nodes your cluster has",
        )


def _group_problems(doc: dict[str, Any]) -> Iterator[tuple[str, str]]:
    """Rules of KubeRay's and Volcano's own validation across the fields of a group or task."""
    spec = _dict(doc.get("spec"))
    if doc.get("kind") == "RayJob":
        groups = _list(_dict(spec.get("rayClusterSpec")).get("workerGroupSpecs"))
        names = [g.get("groupName") for g in groups if isinstance(g, dict)]
        for name in sorted({n for n in names if names.count(n) > 1}, key=str):
            yield "spec.rayClusterSpec.workerGroupSpecs", f"worker group name {name!r} is used twice"
        for i, group in enumerate(groups):
            if not isinstance(group, dict):
                continue
            low, now, high = (_int(group.get(k)) for k in ("minReplicas", "replicas", "maxReplicas"))
            where = f"spec.rayClusterSpec.workerGroupSpecs[{i}]"
            if low is not None and high is not None and low > high:
                yield f"{where}.minReplicas", f"{low} exceeds maxReplicas {high}"
            elif now is not None and ((low is not None and now < low) or (high is not None and now > high)):
                yield f"{where}.replicas", f"{now} is outside minReplicas..maxReplicas ({low}..{high})"
    elif doc.get("kind") == "Job":
        tasks = [t for t in _list(spec.get("tasks")) if isinstance(t, dict)]
        names = [t.get("name") for t in tasks]
        for name in sorted({n for n in names if names.count(n) > 1}, key=str):
            yield "spec.tasks", f"task name {name!r} is used twice"
        replicas = [_int(t.get("replicas", 1)) for t in tasks]
        minimum = _int(spec.get("minAvailable"))
        if minimum is not None and all(r is not None for r in replicas):
            total = sum(r for r in replicas if r is not None)
            if minimum > total:
                yield "spec.minAvailable", f"{minimum} exceeds the {total} pods of the job's tasks (their replicas)"


def _extended_resource_problems(where: str, resources: dict[str, Any]) -> Iterator[tuple[str, str]]:
    """The API server's rule for device-plugin resources: requested only with a limit, and equal to it."""
    limits, requests = resources.get("limits") or {}, resources.get("requests") or {}
    if not (isinstance(limits, dict) and isinstance(requests, dict)):
        return  # a wrong type: the schema names it
    for resource in sorted(set(limits) | set(requests)):
        if _NATIVE_RESOURCE.match(str(resource)):
            continue
        if resource not in limits:
            yield f"{where}.resources.limits", f"extended resource {resource!r} is requested without a limit"
        elif resource in requests and str(requests[resource]) != str(limits[resource]):
            yield (
                f"{where}.resources.requests.{resource}",
                f"{requests[resource]!r} differs from the limit {limits[resource]!r}: "
                "an extended resource cannot be overcommitted",
            )


def _pod_problems(path: str, pod: dict[str, Any]) -> Iterator[tuple[str, str]]:
    volumes = [v.get("name") for v in _list(pod.get("volumes")) if isinstance(v, dict)]
    for name in {v for v in volumes if volumes.count(v) > 1}:
        yield f"{path}.volumes", f"volume name {name!r} is used twice"
    containers = pod.get("containers")
    if not containers:
        yield f"{path}.containers", "required: a pod needs at least one container"
    names: list[str] = []
    for field in ("initContainers", "containers"):
        for i, container in enumerate(_list(pod.get(field))):
            if not isinstance(container, dict):
                continue
            where = f"{path}.{field}[{i}]"
            name = container.get("name")
            names.append(name)
            if not isinstance(name, str) or not DNS1123_LABEL.match(name) or len(name) > LABEL_MAX:
                yield f"{where}.name", f"{name!r} must be a DNS-1123 label"
            image = container.get("image")
            if not isinstance(image, str) or not image.strip():
                yield f"{where}.image", "required: a container without an image is rejected by the API server"
            for j, mount in enumerate(_list(container.get("volumeMounts"))):
                if isinstance(mount, dict) and mount.get("name") not in volumes:
                    known = ", ".join(map(str, volumes)) or "none"
                    yield (
                        f"{where}.volumeMounts[{j}].name",
                        f"{mount.get('name')!r} is not a volume of this pod ({known})",
                    )
            yield from _extended_resource_problems(where, _dict(container.get("resources")))
    for name in {n for n in names if names.count(n) > 1}:
        yield f"{path}.containers", f"container name {name!r} is used twice"


def validate_document(doc: Any, label: str, max_nodes: int = DEFAULT_MAX_NODES) -> list[Problem]:
    """Problems of one parsed document; raises ManifestError for a document of an unknown kind."""
    if not isinstance(doc, dict):
        raise ManifestError(f"{label}: a Kubernetes object must be a mapping, found {type(doc).__name__}")
    key = (doc.get("apiVersion"), doc.get("kind"))
    if key not in SUPPORTED:
        known = ", ".join(f"{a} {k}" for a, k in SUPPORTED)
        raise ManifestError(
            f"{label}: apiVersion {key[0]!r} kind {key[1]!r} is not one this validator has a schema for ({known})"
        )
    document = f"{label} {key[1]} {_dict(doc.get('metadata')).get('name', '(unnamed)')}"
    problems = [
        Problem(document, _format_path(error.absolute_path), _message(error))
        for error in sorted(_validator(*key).iter_errors(doc), key=lambda e: list(map(str, e.absolute_path)))
    ]
    problems += [Problem(document, p, m) for p, m in _name_problems(doc)]
    problems += [Problem(document, p, m) for p, m in _group_problems(doc)]
    problems += [Problem(document, p, m) for p, m in _size_problems(doc, max_nodes)]
    for path, pod in pod_templates(doc):
        problems += [Problem(document, p, m) for p, m in _pod_problems(path, pod)]
    return problems


def _loader():
    """PyYAML's safe loader without aliases (a few lines of ``*alias`` make a document the validator walks in
    exponential time; manifests never need one), with a nesting bound (its composer recurses per level), and
    without duplicate keys (PyYAML keeps the last of two values silently; the API server refuses the object)."""
    import yaml

    class Loader(yaml.SafeLoader):
        depth = 0

        def compose_node(self, parent, index):
            if self.check_event(yaml.AliasEvent):
                mark = self.peek_event().start_mark
                raise ManifestError(f"line {mark.line + 1}: a YAML alias: write the value out (manifests need none)")
            self.depth += 1
            try:
                if self.depth > MAX_DEPTH:
                    mark = self.peek_event().start_mark
                    raise ManifestError(f"line {mark.line + 1}: nested more than {MAX_DEPTH} levels deep")
                return super().compose_node(parent, index)
            finally:
                self.depth -= 1

        def construct_mapping(self, node, deep=False):
            seen = set()
            for key_node, _ in node.value:
                key = self.construct_object(key_node, deep=deep)
                with contextlib.suppress(TypeError):  # an unhashable key: PyYAML's own error names it
                    if key in seen:
                        line = key_node.start_mark.line + 1
                        raise ManifestError(f"line {line}: key {key!r} is given twice in one mapping (a YAML "
                                            "reader keeps one of the two values): keep one")  # fmt: skip
                    seen.add(key)
            return super().construct_mapping(node, deep)

    return Loader


def load_documents(text: str, source: str) -> list[Any]:
    import yaml

    try:
        docs = [d for d in yaml.load_all(text, Loader=_loader()) if d is not None]
    except yaml.YAMLError as exc:
        raise ManifestError(f"{source}: not valid YAML: {exc}") from None
    except ManifestError as exc:
        raise ManifestError(f"{source}: {exc}") from None
    if not docs:
        raise ManifestError(f"{source}: no Kubernetes documents in the file")
    return docs


def validate_documents(docs: list[Any], source: str, max_nodes: int = DEFAULT_MAX_NODES) -> list[Problem]:
    problems = []
    for index, doc in enumerate(docs, start=1):
        problems += validate_document(doc, f"{source} #{index}", max_nodes)
    return problems


def validate_file(path: Path, max_nodes: int = DEFAULT_MAX_NODES) -> list[Problem]:
    """Problems of the manifests in ``path``; ManifestError when it is not read (not a regular file, larger than
    MAX_MANIFEST_BYTES, not UTF-8: at once, never blocking) or not Kubernetes documents."""
    try:
        text = read_text(path, MAX_MANIFEST_BYTES)
    except NotReadable as exc:
        raise ManifestError(f"{path}: cannot read: {exc}") from None
    return validate_documents(load_documents(text, str(path)), str(path), max_nodes)
