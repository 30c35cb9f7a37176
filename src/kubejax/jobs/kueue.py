"""Kueue: the labels that queue a job, and why a queued job waits.

Facts from Kueue v0.19.2 (`../shared/SWEEPS.md`): a TrainJob or JAXJob labelled
`kueue.x-k8s.io/queue-name: <LocalQueue>` is suspended by Kueue's webhook (TrainJob
`spec.suspend`, JAXJob `spec.runPolicy.suspend`) until its `Workload` is admitted, then
unsuspended; `kueue.x-k8s.io/priority-class` names a `WorkloadPriorityClass`. The job reports
the wait as a `Suspended` condition; the reason it waits is on its Workload (owned by the job,
labelled `kueue.x-k8s.io/job-uid`): condition `QuotaReserved` false with a reason (Pending,
WaitingForQuota, ...) and a message ("couldn't assign flavors to pod set node: insufficient
quota for nvidia.com/gpu ...").
"""

from __future__ import annotations

import re

GROUP, VERSION, WORKLOADS = "kueue.x-k8s.io", "v1beta2", "workloads"
QUEUE_LABEL = f"{GROUP}/queue-name"
PRIORITY_LABEL = f"{GROUP}/priority-class"
JOB_UID_LABEL = f"{GROUP}/job-uid"
# A label value: at most 63 characters, alphanumerics with '-', '_', '.' inside.
_LABEL_VALUE = re.compile(r"^[A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?$")


def check_name(setting: str, value: str) -> None:
    """ValueError naming `setting` unless `value` is empty or a valid label value."""
    if value and not _LABEL_VALUE.match(value):
        raise ValueError(
            f"{setting}: {value!r} is not a Kubernetes name (letters, digits, '-', '_' and "
            "'.', starting and ending with a letter or digit, at most 63 characters)"
        )


def labels(queue_name: str, priority_class: str) -> dict[str, str]:
    """The labels that put a job in Kueue's `queue_name` at `priority_class` (those set)."""
    out = {}
    if queue_name:
        out[QUEUE_LABEL] = queue_name
    if priority_class:
        out[PRIORITY_LABEL] = priority_class
    return out


def workload_reason(custom_api, namespace: str, job_uid: str) -> str:
    """Why the job of `job_uid` waits, from its Workload's `QuotaReserved` condition
    ("WaitingForQuota: couldn't assign flavors ..."); '' when no Workload says, or it cannot
    be read (no Kueue, no RBAC on workloads): the caller still says "queued"."""
    if not job_uid:
        return ""
    try:
        items = custom_api.list_namespaced_custom_object(
            GROUP, VERSION, namespace, WORKLOADS, label_selector=f"{JOB_UID_LABEL}={job_uid}"
        ).get("items", [])
    except Exception:  # Kueue absent, an API or RBAC error: the reason is optional
        return ""
    for item in items:
        for cond in (item.get("status") or {}).get("conditions") or []:
            if cond.get("type") == "QuotaReserved" and str(cond.get("status")) != "True":
                reason, message = cond.get("reason", ""), cond.get("message", "")
                return ": ".join(p for p in (reason, message) if p)
    return ""
