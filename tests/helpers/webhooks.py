"""The operators' validating admission webhooks, ported to Python: what ``kubectl apply`` refuses after the CRD
schema has passed (``tests/helpers/crds.py``). Each rule is ported from the Go source at the release whose CRD is
vendored in ``tests/data/crds``, and names its file and tag beside it; the messages are the Go ones, formatted as
``k8s.io/apimachinery``'s ``field.Error`` prints them (``<path>: Invalid value: "<value>": <detail>``), so a test
can match what the API server would answer.

Ported (each only as far as it reaches what a manifest of ``ddptrain-k8s`` can hold):

- Kubeflow Trainer v2.3.0, ``pkg/webhooks/trainjob_webhook.go`` (``ValidateCreate``: the referenced runtime's
  validation plugins), with ``pkg/runtime/framework/plugins/jobset/jobset.go`` (``JobSet.Validate``: every
  ``runtimePatches[].manager`` a domain-prefixed path; a patch names only replicated jobs and containers of the
  runtime's template, checked as Go checks it, against the template with the patches already merged in, so it
  never refuses a new job (``merged_names``); no ``env`` in a patch of the ``node``/initializer containers;
  initializer jobs present when ``spec.initializer`` asks for them, not their containers' names and mounts) and
  ``pkg/runtime/framework/plugins/torch/torch.go`` (``Torch.Validate``: no torchrun variable in ``trainer.env``),
  for a TrainJob on the ``torch-distributed`` ClusterTrainingRuntime of
  ``manifests/base/runtimes/torch_distributed.yaml`` at that tag (one replicated job ``node``, one container
  ``node``, ``mlPolicy.torch: {}``);
- Training Operator v1.9.0, ``pkg/webhooks/pytorch/pytorchjob_webhook.go`` (``validatePyTorchJob``) with
  ``pkg/common/util/webhooks.go`` (``ValidateRunPolicy``);
- JobSet v0.9.1, ``pkg/webhooks/jobset_webhook.go`` (``ValidateCreate``), applied after its defaulting webhook and
  the CRD's defaults as the API server does (``groupName: default``, ``replicas: 1``), with its failure-policy rule
  names (``validateFailurePolicy``: 1 to 128 characters of the format the v0.9.1 CRD's description states; the
  message as the webhook's source at its main branch words it, since ``--replica-groups`` names a rule);
- k8s.io/apimachinery's ``pkg/util/validation/validation.go`` (``IsDomainPrefixedPath``, ``IsDNS1123Subdomain``,
  ``IsDNS1035Label``; identical at v0.36.2, Trainer v2.3.0's, and v0.31.3, Training Operator v1.9.0's) and
  ``pkg/api/validation/generic.go`` (``NameIsDNS1035Label``).

Not ported: the update rules (immutability of ``runtimePatches`` unless suspended, ``ValidateRunPolicyUpdate``:
``ddptrain-k8s`` prints new jobs), checks that read the cluster beyond the runtime above (a ClusterTrainingRuntime
the cluster does not have), the Trainer plugins of other runtimes (MPI, JAX, XGBoost, Flux, Volcano), JobSet's
``coordinator`` (never emitted), and every mutating webhook except JobSet's
defaults used above (Trainer's defaulter only stamps ``runtimePatches[].time``).
"""

from __future__ import annotations

import re
from typing import Any

# ---- k8s.io/apimachinery pkg/util/validation/validation.go (v0.36.2 = v0.31.3 for these) ----------------------

DNS1123_LABEL = "[a-z0-9]([-a-z0-9]*[a-z0-9])?"
DNS1123_SUBDOMAIN = DNS1123_LABEL + r"(\." + DNS1123_LABEL + ")*"
DNS1123_SUBDOMAIN_MSG = ("a lowercase RFC 1123 subdomain must consist of lower case alphanumeric characters, '-' or "
                         "'.', and must start and end with an alphanumeric character")
DNS1035_LABEL = "[a-z]([-a-z0-9]*[a-z0-9])?"
DNS1035_LABEL_MSG = ("a DNS-1035 label must consist of lower case alphanumeric characters or '-', start with an "
                     "alphabetic character, and end with an alphanumeric character")
HTTP_PATH = r"[A-Za-z0-9/\-._~%!$&'()*+,;=:]+"


def regex_error(msg: str, fmt: str, *examples: str) -> str:
    """``RegexError`` (its examples joined as Go joins them: ``'a',  or 'b', ``)."""
    if not examples:
        return f"{msg} (regex used for validation is '{fmt}')"
    shown = " or ".join(f"'{e}', " for e in examples)
    return f"{msg} (e.g. {shown}regex used for validation is '{fmt}')"


def max_len_error(length: int) -> str:
    return f"must be no more than {length} characters"


def invalid(path: str, value: Any, detail: str) -> str:
    """``field.Invalid(...).Error()`` for a string or integer value."""
    shown = f'"{value}"' if isinstance(value, str) else str(value)
    return f"{path}: Invalid value: {shown}: {detail}"


def is_dns1123_subdomain(value: str) -> list[str]:
    errs = [max_len_error(253)] if len(value) > 253 else []
    if not re.fullmatch(DNS1123_SUBDOMAIN, value):
        errs.append(regex_error(DNS1123_SUBDOMAIN_MSG, DNS1123_SUBDOMAIN, "example.com"))
    return errs


def is_dns1035_label(value: str) -> list[str]:
    errs = [max_len_error(63)] if len(value) > 63 else []
    if not re.fullmatch(DNS1035_LABEL, value):
        errs.append(regex_error(DNS1035_LABEL_MSG, DNS1035_LABEL, "my-name", "abc-123"))
    return errs


def is_domain_prefixed_path(path: str, value: str) -> list[str]:
    """``IsDomainPrefixedPath``: ``acme.io/foo``, a DNS-1123 subdomain, a slash, an HTTP path."""
    if not value:
        return [f"{path}: Required value"]
    host, slash, rest = value.partition("/")
    if not slash or not host or not rest:
        return [invalid(path, value, 'must be a domain-prefixed path (such as "acme.io/foo")')]
    errs = [invalid(path, host, e) for e in is_dns1123_subdomain(host)]
    if not re.fullmatch(HTTP_PATH, rest):
        errs.append(invalid(path, rest, regex_error("Invalid path", HTTP_PATH)))
    return errs


# ---- Kubeflow Trainer v2.3.0 ------------------------------------------------------------------------------------

# manifests/base/runtimes/torch_distributed.yaml at v2.3.0: replicated job -> its containers
TORCH_DISTRIBUTED = {"node": {"node"}}
RUNTIMES = {("ClusterTrainingRuntime", "torch-distributed"): TORCH_DISTRIBUTED}
# pkg/constants/constants.go at v2.3.0
TORCHRUN_RESERVED_ENV = ("PET_NNODES", "PET_NPROC_PER_NODE", "PET_NODE_RANK", "PET_MASTER_ADDR", "PET_MASTER_PORT")
DATASET_INITIALIZER, MODEL_INITIALIZER, NODE = "dataset-initializer", "model-initializer", "node"
CONTAINER_TRAINER_PORT = 29500  # ContainerTrainerPort: the port PET_MASTER_PORT names


def merged_names(runtime: dict[str, set[str]], patches: list[dict[str, Any]]) -> dict[str, set[str]]:
    """The replicated jobs and their (init) container names of the runtime's template *after* the TrainJob's
    patches are merged into it: ``TrainingRuntime.newRuntimeInfo`` (pkg/runtime/core/trainingruntime.go, v2.3.0)
    runs ``mergeRuntimePatches`` (a strategic merge patch, patch by patch) before building the ``runtime.Info`` the
    validation plugins read, and JobSet's ``replicatedJobs`` (v0.12.0, Trainer's) and a pod's ``containers`` /
    ``initContainers`` merge by ``name``: a patch's new job or container is added to the template, so the plugin's
    "doesn't exist in the runtime" rules see it as existing. Those rules therefore never refuse a new TrainJob (a
    merge that fails leaves no runtime.Info; not modelled)."""
    names = {job: set(containers) for job, containers in runtime.items()}
    for patch in patches:
        template = (patch.get("trainingRuntimeSpec") or {}).get("template") or {}
        for job in (template.get("spec") or {}).get("replicatedJobs", []):
            pod = (((job.get("template") or {}).get("spec") or {}).get("template") or {}).get("spec") or {}
            names.setdefault(job.get("name", ""), set()).update(
                c["name"] for c in [*pod.get("initContainers", []), *pod.get("containers", [])])
    return names


def trainjob_errors(doc: dict[str, Any]) -> list[str]:
    """``TrainJobValidator.ValidateCreate`` (pkg/webhooks/trainjob_webhook.go, v2.3.0) for the runtimes above."""
    spec = doc.get("spec", {})
    ref = spec.get("runtimeRef", {})
    key = (ref.get("kind", "ClusterTrainingRuntime"), ref.get("name"))
    if key not in RUNTIMES:
        return [f"spec.runtimeRef: {key[0]} {key[1]} is not one of the runtimes these rules were ported for"]
    patches = spec.get("runtimePatches", [])
    jobs = merged_names(RUNTIMES[key], patches)
    errs: list[str] = []
    # pkg/runtime/framework/plugins/jobset/jobset.go (v2.3.0), JobSet.Validate, on the merged template (above)
    initializer = spec.get("initializer") or {}
    for part, job in (("dataset", DATASET_INITIALIZER), ("model", MODEL_INITIALIZER)):
        if initializer.get(part) is not None and job not in jobs:
            errs.append(f"spec.runtimeRef: Invalid value: must have {job} job when trainJob is configured with "
                         f"input {part}Config")
    for patch in patches:
        errs += is_domain_prefixed_path("spec.runtimePatches.manager", patch.get("manager", ""))
        template = (patch.get("trainingRuntimeSpec") or {}).get("template") or {}
        for job in (template.get("spec") or {}).get("replicatedJobs", []):
            if job.get("name", "") not in jobs:
                errs.append("spec.runtimePatches: Invalid value: must not have replicated job that doesn't exist in "
                            "the runtime job template")
                continue
            pod = (((job.get("template") or {}).get("spec") or {}).get("template") or {}).get("spec") or {}
            for init in pod.get("initContainers", []):
                if init["name"] not in jobs[job["name"]]:
                    errs.append("spec.runtimePatches: Invalid value: must not have initContainer that doesn't exist "
                                f"in the runtime job {job['name']}")
            for container in pod.get("containers", []):
                if container["name"] not in jobs[job["name"]]:
                    errs.append("spec.runtimePatches: Invalid value: must not have container that doesn't exist in "
                                f"the runtime job {job['name']}")
                elif container.get("env") and container["name"] in (DATASET_INITIALIZER, MODEL_INITIALIZER, NODE):
                    errs.append(f"spec.runtimePatches: Invalid value: must not have envs for the {DATASET_INITIALIZER}"
                                f", {MODEL_INITIALIZER}, {NODE} containers")
    # pkg/runtime/framework/plugins/torch/torch.go (v2.3.0), Torch.Validate (the runtime's mlPolicy has torch)
    reserved = sorted({e["name"] for e in (spec.get("trainer") or {}).get("env", [])} & set(TORCHRUN_RESERVED_ENV))
    if reserved:
        errs.append(f"spec.trainer.env: Invalid value: must not have reserved envs, invalid envs configured: "
                    f"[{' '.join(reserved)}]")
    return errs


# ---- Training Operator v1.9.0 -----------------------------------------------------------------------------------

# pkg/common/util/webhooks.go and pkg/apis/kubeflow.org/v1/common_types.go at v1.9.0
SUPPORTED_JOB_CONTROLLERS = ("kueue.x-k8s.io/multikueue", "kubeflow.org/training-operator")
PYTORCH_DEFAULT_CONTAINER = "pytorch"


def pytorchjob_errors(doc: dict[str, Any]) -> list[str]:
    """``validatePyTorchJob`` (pkg/webhooks/pytorch/pytorchjob_webhook.go, v1.9.0) of a new job."""
    errs: list[str] = []
    name = doc.get("metadata", {}).get("name", "")
    if found := is_dns1035_label(name):
        errs.append(invalid("metadata.name", name, f"should match: {','.join(found)}"))
    spec = doc.get("spec", {})
    managed_by = (spec.get("runPolicy") or {}).get("managedBy")
    if managed_by is not None and managed_by not in SUPPORTED_JOB_CONTROLLERS:
        errs.append(f'spec.runPolicy.managedBy: Unsupported value: "{managed_by}"')
    replicas = spec.get("pytorchReplicaSpecs")
    if spec.get("elasticPolicy") is not None:
        if "Worker" not in (replicas or {}):
            errs.append("spec.pytorchReplicaSpecs[Worker]: Required value: must be configured if elastic policy is "
                        "used")
        if spec["elasticPolicy"].get("nProcPerNode") is not None and spec.get("nprocPerNode") is not None:
            errs.append("spec.elasticPolicy.nProcPerNode: Forbidden: must not be used with spec.nprocPerNode")
    if replicas is None:
        errs.append("spec.pytorchReplicaSpecs: Required value: must be required")
    for role, replica in (replicas or {}).items():
        path = f"spec.pytorchReplicaSpecs[{role}]"
        if role not in ("Master", "Worker"):
            errs.append(f'{path}: Unsupported value: "{role}": supported values: "Master", "Worker"')
        containers = (((replica or {}).get("template") or {}).get("spec") or {}).get("containers") or []
        if not containers:
            errs.append(f"{path}.template.spec.containers: Required value: must be specified")
        for i, container in enumerate(containers):
            if not container.get("image"):
                errs.append(f"{path}.template.spec.containers[{i}].image: Required value: must be required")
        if not any(c.get("name") == PYTORCH_DEFAULT_CONTAINER for c in containers):
            errs.append(f"{path}.template.spec.containers: Required value: must have at least one container with "
                        f"name {PYTORCH_DEFAULT_CONTAINER}")
        count = (replica or {}).get("replicas")
        if role == "Master" and count != 1:
            errs.append(f"{path}.replicas: Forbidden: must be 1")
        elif role != "Master" and count is not None and count < 1:
            errs.append(f"{path}.replicas: Forbidden: must be at least 1")
    return errs


# ---- JobSet v0.9.1 ------------------------------------------------------------------------------------------------

MAX_MANAGED_BY = 63
VALID_JOB_FAILURE_REASONS = ("BackoffLimitExceeded", "DeadlineExceeded", "FailedIndexes", "MaxFailedIndexesExceeded",
                             "PodFailurePolicy")
TOO_LONG = "must be no more than 63 characters"  # dns1035MaxLengthExceededErrorMsg
RULE_NAME = "[A-Za-z]([A-Za-z0-9_,:]*[A-Za-z0-9_])?"  # ruleNameFmt


def _dns1035(path: str, value: str, too_long: str) -> list[str]:
    return [invalid(path, value, too_long if TOO_LONG in e else e) for e in is_dns1035_label(value)]


def jobset_errors(doc: dict[str, Any]) -> list[str]:
    """``jobSetWebhook.ValidateCreate`` (pkg/webhooks/jobset_webhook.go, v0.9.1) after the CRD's defaults."""
    errs: list[str] = []
    name, spec = doc.get("metadata", {}).get("name", ""), doc.get("spec", {})
    jobs = spec.get("replicatedJobs", [])
    if jobs and jobs[0].get("dependsOn") is not None:
        errs.append("DependsOn can't be set for the first ReplicatedJob")
    if subdomain := (spec.get("network") or {}).get("subdomain"):
        errs += [invalid("spec.network.subdomain", subdomain, e) for e in is_dns1123_subdomain(subdomain)]
        errs += _dns1035("spec.network.subdomain", subdomain,
                         ".spec.network.subdomain is too long, must be less than 63 characters")
    if (managed_by := spec.get("managedBy")) is not None:
        errs += is_domain_prefixed_path("spec.managedBy", managed_by)
        if len(managed_by) > MAX_MANAGED_BY:
            errs.append(f"spec.managedBy: Too long: may not be more than {MAX_MANAGED_BY} bytes")
    names: set[str] = set()
    for i, job in enumerate(jobs):
        path = f"spec.replicatedJobs[{i}]"
        names.add(job["name"])
        replicas, template = job.get("replicas", 1), job["template"].get("spec", {})
        if template.get("parallelism", 1) * replicas > 2**31 - 1:
            errs.append(f"the product of replicas and parallelism must not exceed {2**31 - 1} for replicatedJob "
                        f"'{job['name']}'")
        errs += _dns1035(f"{path}.groupName", job.get("groupName", "default"),
                         ".spec.replicatedJob[].groupName is too long, must be less than 63 characters")
        longest_job = f"{name}-{job['name']}-{replicas - 1}"  # placement.GenJobName
        errs += _dns1035(f"{path}.name", longest_job,
                         "JobSet name is too long, job names generated for this JobSet will exceed 63 characters")
        if template.get("completionMode", "Indexed") == "Indexed" and template.get("completions") is not None:
            longest_pod = f"{longest_job}-{template['completions'] - 1}-abcde"  # placement.GenPodName + suffix
            errs += [invalid(f"{path}.name", longest_job, "JobSet name is too long, pod names generated for this "
                             "JobSet will exceed 63 characters" if TOO_LONG in e else e)
                     for e in is_dns1035_label(longest_pod)]
        for dep in job.get("dependsOn") or []:
            if dep["name"] not in names:
                errs.append(f"replicatedJob: {job['name']} cannot depend on replicatedJob: {dep['name']}")
    for target in (spec.get("successPolicy") or {}).get("targetReplicatedJobs", []):
        if target not in names:
            errs.append(f"invalid replicatedJob name '{target}' does not appear in .spec.ReplicatedJobs")
    rules = (spec.get("failurePolicy") or {}).get("rules", [])
    rule_names = [r.get("name") or f"failurePolicyRule{i}" for i, r in enumerate(rules)]  # the defaulter's names
    for rule, rule_name in zip(rules, rule_names, strict=True):
        if not 1 <= len(rule_name) <= 128:
            errs.append(f"invalid failure policy rule name of length {len(rule_name)}, the rule name must be at "
                        "least 1 characters long and at most 128 characters long")
        if not re.fullmatch(RULE_NAME, rule_name):
            errs.append(f"invalid failure policy rule name '{rule_name}', a failure policy rule name must start "
                        "with an alphabetic character, optionally followed by a string of alphanumeric characters or "
                        "'_,:', and must end with an alphanumeric character or '_'")
        for target in rule.get("targetReplicatedJobs", []):
            if target not in names:
                errs.append(f"invalid replicatedJob name '{target}' in failure policy does not appear in "
                            ".spec.ReplicatedJobs")
        for reason in rule.get("onJobFailureReasons", []):
            if reason not in VALID_JOB_FAILURE_REASONS:
                errs.append(f"invalid job failure reason '{reason}' in failure policy is not a recognized job failure "
                            "reason")
    errs += [f"rule names are not unique, rules all have the same name '{n}'" for n in sorted(
        {n for n in rule_names if rule_names.count(n) > 1})]
    return errs


def admission_errors(manifest: dict[str, Any]) -> list[str]:
    """Every way ``manifest`` breaks its operator's ported validating webhook (empty when it would be admitted)."""
    return {"TrainJob": trainjob_errors, "PyTorchJob": pytorchjob_errors, "JobSet": jobset_errors}[
        manifest["kind"]](manifest)
