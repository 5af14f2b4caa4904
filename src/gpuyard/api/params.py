"""Path and query parameter types with the bounds of :mod:`gpuyard.limits`."""

from __future__ import annotations

from typing import Annotated

from fastapi import Path, Query

from gpuyard.limits import MAX_ID, MAX_OFFSET, NAME_LEN, REF_LEN

JobId = Annotated[int, Path(ge=1, le=MAX_ID, description="a job id")]
DeploymentId = Annotated[int, Path(ge=1, le=MAX_ID, description="a deployment id")]
TokenId = Annotated[int, Path(ge=1, le=MAX_ID, description="a token id")]
Version = Annotated[int, Path(ge=1, le=MAX_ID, description="a model version")]
Offset = Annotated[int, Query(ge=0, le=MAX_OFFSET, description="byte offset into the log")]
Name = Annotated[str, Path(min_length=1, max_length=NAME_LEN)]
Ref = Annotated[str, Path(min_length=1, max_length=REF_LEN)]
# A node is named by its host name: at most 253 characters (DNS).
NodeName = Annotated[str, Path(min_length=1, max_length=253, description="a node's name")]
