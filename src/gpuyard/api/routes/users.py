"""/me, /users and /tokens: who is calling; users and API tokens (admin only, except /me)."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Depends
from pydantic import BaseModel, ConfigDict, Field

from gpuyard.api.auth import authenticated
from gpuyard.api.params import Name, TokenId
from gpuyard.auth import MAX_TOKEN_DAYS, Principal, require_admin
from gpuyard.limits import NAME_LEN, WORD_LEN

router = APIRouter(tags=["users"])


class NewUser(BaseModel):
    """A user to create."""

    model_config = ConfigDict(extra="forbid")

    name: str = Field(..., max_length=NAME_LEN)
    team: str = Field("default", max_length=NAME_LEN)
    role: str = Field("member", max_length=WORD_LEN, description="admin, member or viewer")


class NewToken(BaseModel):
    """A token to create for a user."""

    model_config = ConfigDict(extra="forbid")

    label: str = Field("", max_length=100)
    expires_days: float | None = Field(None, gt=0, le=MAX_TOKEN_DAYS, description="lifetime in days")


@router.get("/me")
def me(principal: Principal = Depends(authenticated)) -> dict[str, Any]:
    """The calling user, their team and role."""
    return {"user": principal.user, "team": principal.team, "role": principal.role}


@router.get("/users")
def users(principal: Principal = Depends(authenticated)) -> list[dict[str, Any]]:
    """Every user (admin)."""
    from gpuyard.auth import list_users

    require_admin(principal)
    return list_users()


@router.post("/users", status_code=201)
def add(req: NewUser, principal: Principal = Depends(authenticated)) -> dict[str, Any]:
    """Create a user (admin)."""
    from gpuyard.auth import add_user

    require_admin(principal)
    return add_user(req.name, req.team, req.role)


@router.get("/tokens")
def tokens(principal: Principal = Depends(authenticated)) -> list[dict[str, Any]]:
    """Token records, never the tokens: every user's for an admin, else the caller's own."""
    from gpuyard.auth import list_tokens

    return list_tokens(None if principal.is_admin else principal.user)


@router.post("/users/{name}/tokens", status_code=201)
def create(name: Name, req: NewToken, principal: Principal = Depends(authenticated)) -> dict[str, Any]:
    """Create a token for user ``name`` (admin); the answer is the only place the token appears."""
    from gpuyard.auth import create_token

    require_admin(principal)
    token, doc = create_token(name, req.label, req.expires_days)
    return doc | {"token": token}


@router.post("/tokens/{token_id}/revoke")
def revoke(token_id: TokenId, principal: Principal = Depends(authenticated)) -> dict[str, Any]:
    """Revoke a token (admin)."""
    from gpuyard.auth import revoke_token

    require_admin(principal)
    return revoke_token(token_id)
