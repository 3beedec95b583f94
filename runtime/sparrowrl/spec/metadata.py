"""A job's `metadata`: Kubernetes' ObjectMeta, checked against Kubernetes' own limits so that a job
`sparrowrl run` accepts is one a cluster accepts too."""

from __future__ import annotations

import datetime
import re
from typing import Annotated, Any

from pydantic import AfterValidator, ConfigDict, Field

from sparrowrl.spec.section import Section

_LABEL_NAME = r"([A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?)"
_KEY = re.compile(rf"^([a-z0-9]([-a-z0-9.]{{0,251}}[a-z0-9])?/)?{_LABEL_NAME}$")
_LABEL_VALUE = re.compile(rf"^{_LABEL_NAME}?$")
MAX_ANNOTATION_BYTES = 256 << 10


def _labels(labels: dict[str, str]) -> dict[str, str]:
    for k, v in labels.items():
        if not _KEY.match(k):
            raise ValueError(f"label key {k!r} is not [prefix/]name (name: 63 characters at most)")
        if not _LABEL_VALUE.match(v):
            raise ValueError(f"label {k!r}: value {v!r} is not 63 characters at most of [-A-Za-z0-9_.]")
    return labels


def _annotations(annotations: dict[str, str]) -> dict[str, str]:
    for k in annotations:
        if not _KEY.match(k):
            raise ValueError(f"annotation key {k!r} is not [prefix/]name (name: 63 characters at most)")
    size = sum(len(k.encode()) + len(v.encode()) for k, v in annotations.items())
    if size > MAX_ANNOTATION_BYTES:
        raise ValueError(f"annotations take {size:,} bytes (Kubernetes allows {MAX_ANNOTATION_BYTES:,})")
    return annotations


Short = Annotated[str, Field(max_length=253)]
DnsLabel = Annotated[str, Field(pattern=r"^[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?$")]
Timestamp = Annotated[str, Field(max_length=64)] | datetime.datetime  # YAML reads an unquoted one as a datetime


class OwnerReference(Section):
    model_config = ConfigDict(extra="forbid", frozen=True)
    api_version: Short = Field(alias="apiVersion")
    kind: Short
    name: Short
    uid: Short
    controller: bool | None = None
    block_owner_deletion: bool | None = Field(None, alias="blockOwnerDeletion")


class Metadata(Section):
    """Kubernetes' ObjectMeta, with Kubernetes' own limits: what a job file or an object read
    back from a cluster (`kubectl get -o yaml`) carries. The server-set fields are accepted and
    not used; `managedFields` is opaque, bounded by the job file's own limits."""

    model_config = ConfigDict(extra="forbid", frozen=True, populate_by_name=True)
    name: DnsLabel
    namespace: DnsLabel | None = None
    labels: Annotated[dict[str, str], AfterValidator(_labels)] = {}
    annotations: Annotated[dict[str, str], AfterValidator(_annotations)] = {}
    generate_name: Short | None = Field(None, alias="generateName")
    uid: Short | None = None
    resource_version: Short | None = Field(None, alias="resourceVersion")
    generation: int | None = Field(None, ge=0, lt=2**63)
    creation_timestamp: Timestamp | None = Field(None, alias="creationTimestamp")
    deletion_timestamp: Timestamp | None = Field(None, alias="deletionTimestamp")
    deletion_grace_period_seconds: int | None = Field(None, ge=0, lt=2**63, alias="deletionGracePeriodSeconds")
    finalizers: Annotated[list[Short], Field(max_length=64)] = []
    owner_references: Annotated[list[OwnerReference], Field(max_length=64)] = Field([], alias="ownerReferences")
    managed_fields: Annotated[list[dict[str, Any]], Field(max_length=64)] = Field([], alias="managedFields")
