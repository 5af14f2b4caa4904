"""Exception types a user may see; the CLI prints them in one line and exits 2, the API answers 4xx."""


class GpuyardError(Exception):
    """Base of every error gpuyard reports to a user (never a bug)."""

    http_status = 400


class ConfigError(GpuyardError):
    """A setting, spec or file given by the user is invalid; the message names the field."""

    http_status = 422


class NotFoundError(GpuyardError):
    """A named thing (preset, dataset, job, model version, ...) does not exist."""

    http_status = 404


class ConflictError(GpuyardError):
    """The request contradicts the current state (already exists, wrong stage, ...)."""

    http_status = 409


class StoreError(GpuyardError):
    """The state or artifact store cannot be reached or refused an operation."""

    http_status = 503


class IntegrityError(GpuyardError):
    """Stored content does not match its recorded hash, or a file is truncated or corrupt."""

    http_status = 500


class CapacityError(GpuyardError):
    """The request can never be met by the resources that exist (e.g. more GPUs than the cluster has)."""

    http_status = 422


class AuthenticationError(GpuyardError):
    """No API token, or one that is unknown, revoked or expired."""

    http_status = 401


class PermissionDenied(GpuyardError):
    """The caller is authenticated but not allowed to do this."""

    http_status = 403


def one_line(text: str, limit: int = 300) -> str:
    """``text`` on one line of printable characters, at most ``limit`` long (for error messages)."""
    flat = " ".join("".join(c if c.isprintable() or c.isspace() else "?" for c in text).split())
    return flat if len(flat) <= limit else flat[: limit - 3] + "..."
