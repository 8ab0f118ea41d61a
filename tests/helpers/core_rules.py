"""What the API server checks of the lighthouse's ``Service`` and ``Deployment`` (``ddptrain/app/k8s_ft.py``), as far
as those documents reach: core types have no CRD here (``tests/helpers/crds.py``), so their rules are ported by hand.

- names: a Service's is an RFC 1035 label (``ValidateServiceName``: ``NameIsDNS1035Label``), a Deployment's an RFC
  1123 subdomain (``ValidateDeploymentName``), a container's an RFC 1123 label;
- labels and selectors: keys qualified names (``[prefix/]name``), values label values (``IsValidLabelValue``);
- ports: numbers 1-65535, names IANA service names (``IsValidPortName``: at most 15 characters of ``[-a-z0-9]`` with
  a letter, no ``--``, no hyphen at either end), protocols TCP, UDP or SCTP;
- a Deployment's selector non-empty and matching its template's labels ("`selector` does not match template
  `labels`", ``ValidateDeploymentSpec``), its pod's restart policy ``Always``;
- the type: ``apiVersion`` the group/version that serves the kind (``v1`` for a Service, ``apps/v1`` for a
  Deployment: anything else is "no matches for kind" from the API server's REST mapping).

``restricted_errors`` is the Pod Security Standard "restricted" (the built-in Pod Security Admission controller,
k8s.io/pod-security-admission ``policy/check_*.go``, enforced where a namespace is labelled
``pod-security.kubernetes.io/enforce=restricted``), for the checks a pod spec without volumes or host namespaces
reaches: ``allowPrivilegeEscalation`` false, ``capabilities.drop`` holding ``ALL`` and ``add`` at most
``NET_BIND_SERVICE``, not ``privileged``, ``runAsNonRoot`` true and ``runAsUser`` not 0 (the container's setting,
else the pod's), and a ``seccompProfile`` of ``RuntimeDefault`` or ``Localhost``.

The rules are k8s.io/apimachinery's ``pkg/util/validation/validation.go`` and k8s.io/kubernetes's
``pkg/apis/core/validation`` and ``pkg/apis/apps/validation``; the messages are shortened (the rule, not Go's exact
text). Checks beyond them that a cluster makes at run time (a probe's named port resolved by the kubelet, a
Service's ``targetPort`` name resolved by the endpoints controller) are in ``wiring_errors``.
"""

from __future__ import annotations

import re
from typing import Any

from tests.helpers.webhooks import DNS1123_LABEL, is_dns1035_label, is_dns1123_subdomain

QUALIFIED_NAME = "([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9]"
PROTOCOLS = ("TCP", "UDP", "SCTP")


def is_valid_label_value(value: str) -> list[str]:
    errs = ["must be no more than 63 characters"] if len(value) > 63 else []
    if value and not re.fullmatch(QUALIFIED_NAME, value):
        errs.append("a valid label must be an empty string or consist of alphanumeric characters, '-', '_' or '.', "
                    "and must start and end with an alphanumeric character")
    return errs


def is_qualified_name(value: str) -> list[str]:
    prefix, slash, name = value.rpartition("/")
    errs = [f"prefix part {e}" for e in is_dns1123_subdomain(prefix)] if slash else []
    if value.count("/") > 1:
        errs.append("a qualified name must have at most one '/'")
    if not name or len(name) > 63 or not re.fullmatch(QUALIFIED_NAME, name):
        errs.append("name part must consist of alphanumeric characters, '-', '_' or '.', and must start and end "
                    "with an alphanumeric character (at most 63)")
    return errs


def is_valid_port_name(port: str) -> list[str]:
    errs = ["must be no more than 15 characters"] if len(port) > 15 else []
    if not re.fullmatch("[-a-z0-9]+", port):
        errs.append("must contain only alpha-numeric characters (a-z, 0-9), and hyphens (-)")
    if not re.search("[a-z]", port):
        errs.append("must contain at least one letter (a-z)")
    if "--" in port:
        errs.append("must not contain consecutive hyphens")
    if port.startswith("-") or port.endswith("-"):
        errs.append("must not begin or end with a hyphen")
    return errs


def label_errors(path: str, labels: dict[str, str]) -> list[str]:
    errs = [f"{path}: Invalid value: \"{k}\": {e}" for k in labels for e in is_qualified_name(k)]
    return errs + [f"{path}: Invalid value: \"{v}\": {e}" for v in labels.values() for e in is_valid_label_value(v)]


def port_errors(path: str, port: dict[str, Any], number_key: str) -> list[str]:
    errs = []
    if not isinstance(port.get(number_key), int) or not 1 <= port[number_key] <= 65535:
        errs.append(f"{path}.{number_key}: Invalid value: {port.get(number_key)}: must be between 1 and 65535")
    if "name" in port:
        errs += [f"{path}.name: Invalid value: \"{port['name']}\": {e}" for e in is_valid_port_name(port["name"])]
    if port.get("protocol", "TCP") not in PROTOCOLS:
        errs.append(f"{path}.protocol: Unsupported value: \"{port['protocol']}\"")
    return errs


def service_errors(doc: dict[str, Any]) -> list[str]:
    name, spec = doc["metadata"]["name"], doc.get("spec", {})
    errs = [f"metadata.name: Invalid value: \"{name}\": {e}" for e in is_dns1035_label(name)]
    errs += label_errors("metadata.labels", doc["metadata"].get("labels", {}))
    errs += label_errors("spec.selector", spec.get("selector", {}))
    ports = spec.get("ports", [])
    if not ports:
        errs.append("spec.ports: Required value")
    for i, port in enumerate(ports):
        errs += port_errors(f"spec.ports[{i}]", port, "port")
        target = port.get("targetPort", port.get("port"))
        if isinstance(target, str):
            errs += [f"spec.ports[{i}].targetPort: Invalid value: \"{target}\": {e}"
                     for e in is_valid_port_name(target)]
        elif not isinstance(target, int) or not 1 <= target <= 65535:
            errs.append(f"spec.ports[{i}].targetPort: Invalid value: {target}: must be between 1 and 65535")
    if len(ports) > 1 and any("name" not in p for p in ports):
        errs.append("spec.ports: Required value: each port must have a name when there are several")
    return errs


def deployment_errors(doc: dict[str, Any]) -> list[str]:
    name, spec = doc["metadata"]["name"], doc.get("spec", {})
    errs = [f"metadata.name: Invalid value: \"{name}\": {e}" for e in is_dns1123_subdomain(name)]
    errs += label_errors("metadata.labels", doc["metadata"].get("labels", {}))
    selector = (spec.get("selector") or {}).get("matchLabels", {})
    template = spec.get("template", {})
    pod_labels = (template.get("metadata") or {}).get("labels", {})
    if not selector:
        errs.append("spec.selector: Invalid value: empty selector is invalid for deployment")
    errs += label_errors("spec.selector.matchLabels", selector)
    errs += label_errors("spec.template.metadata.labels", pod_labels)
    if any(pod_labels.get(k) != v for k, v in selector.items()):
        errs.append("spec.template.metadata.labels: Invalid value: `selector` does not match template `labels`")
    if spec.get("replicas", 1) < 0:
        errs.append("spec.replicas: Invalid value: must be greater than or equal to 0")
    pod = template.get("spec", {})
    if pod.get("restartPolicy", "Always") != "Always":
        errs.append(f"spec.template.spec.restartPolicy: Unsupported value: \"{pod['restartPolicy']}\"")
    containers = pod.get("containers", [])
    if not containers:
        errs.append("spec.template.spec.containers: Required value")
    for i, container in enumerate(containers):
        path = f"spec.template.spec.containers[{i}]"
        if not re.fullmatch(DNS1123_LABEL, container.get("name", "")) or len(container["name"]) > 63:
            errs.append(f"{path}.name: Invalid value: \"{container.get('name')}\": must be an RFC 1123 label")
        if not container.get("image"):
            errs.append(f"{path}.image: Required value")
        for j, port in enumerate(container.get("ports", [])):
            errs += port_errors(f"{path}.ports[{j}]", port, "containerPort")
    return errs


API_VERSIONS = {"Service": "v1", "Deployment": "apps/v1"}


def core_errors(doc: dict[str, Any]) -> list[str]:
    kind = doc.get("kind")
    if kind not in API_VERSIONS:
        return [f"kind: Invalid value: \"{kind}\": expected one of {', '.join(API_VERSIONS)}"]
    errs = [] if doc.get("apiVersion") == API_VERSIONS[kind] else [
        f"no matches for kind \"{kind}\" in version \"{doc.get('apiVersion')}\" (expected {API_VERSIONS[kind]})"]
    return errs + {"Service": service_errors, "Deployment": deployment_errors}[kind](doc)


def restricted_errors(pod: dict[str, Any]) -> list[str]:
    """What the Pod Security Standard "restricted" refuses of a pod spec (the module's docstring lists its checks)."""
    errs = []
    pod_context = pod.get("securityContext") or {}
    for i, container in enumerate(pod.get("containers", [])):
        path = f"spec.containers[{i}].securityContext"
        context = container.get("securityContext") or {}
        if context.get("allowPrivilegeEscalation") is not False:
            errs.append(f"{path}.allowPrivilegeEscalation != false")
        capabilities = context.get("capabilities") or {}
        if "ALL" not in (capabilities.get("drop") or []):
            errs.append(f"{path}.capabilities.drop=[\"ALL\"] is not set")
        if set(capabilities.get("add") or []) - {"NET_BIND_SERVICE"}:
            errs.append(f"{path}.capabilities.add holds more than NET_BIND_SERVICE")
        if context.get("privileged"):
            errs.append(f"{path}.privileged=true")
        if context.get("runAsNonRoot", pod_context.get("runAsNonRoot")) is not True:
            errs.append(f"{path}.runAsNonRoot != true (nor the pod's)")
        if context.get("runAsUser", pod_context.get("runAsUser")) == 0:
            errs.append(f"{path}.runAsUser=0")
        seccomp = (context.get("seccompProfile") or pod_context.get("seccompProfile") or {}).get("type")
        if seccomp not in ("RuntimeDefault", "Localhost"):
            errs.append(f"{path}.seccompProfile.type is {seccomp!r}, not RuntimeDefault or Localhost (nor the pod's)")
    return errs


def selects(selector: dict[str, str], labels: dict[str, str]) -> bool:
    """A Service's (equality-based) selector picks a pod with ``labels``."""
    return bool(selector) and all(labels.get(k) == v for k, v in selector.items())


def wiring_errors(service: dict[str, Any], deployment: dict[str, Any]) -> list[str]:
    """What only shows once the objects run: the Service selects the Deployment's pods, its ``targetPort`` and the
    readiness probe's port name a port of the container, and the container listens (``--bind``) on that port."""
    errs = []
    pod = deployment["spec"]["template"]
    (container,) = pod["spec"]["containers"]
    ports = {p["name"]: p["containerPort"] for p in container.get("ports", [])}
    if not selects(service["spec"]["selector"], pod["metadata"]["labels"]):
        errs.append("the Service's selector does not select the Deployment's pods")
    for port in service["spec"]["ports"]:
        target = port.get("targetPort", port["port"])
        if (ports.get(target) if isinstance(target, str) else target) is None:
            errs.append(f"the Service's targetPort {target} is no port of the container")
    probe = (container.get("readinessProbe") or {}).get("tcpSocket", {}).get("port")
    if probe is None or (isinstance(probe, str) and probe not in ports):
        errs.append(f"the readiness probe's port {probe} is no port of the container")
    args = container.get("args", [])
    bind = args[args.index("--bind") + 1] if "--bind" in args else "[::]:29510"  # torchft_lighthouse's default
    if int(bind.rsplit(":", 1)[1]) not in ports.values():
        errs.append(f"--bind {bind} listens on no port of the container")
    return errs
