"""The cloud service's own errors, under the shared tree (shared/errors.py).

EdgeLoopError
└── ContractError
    ├── NotFoundError        the thing asked for does not exist          -> 404
    ├── ConflictError        the request clashes with stored state       -> 409
    ├── AuthError            missing, unknown or expired credentials     -> 401
    └── ForbiddenError       credentials valid but not enough            -> 403
"""

from __future__ import annotations

from shared.errors import ContractError

__all__ = ["AuthError", "ConflictError", "ForbiddenError", "NotFoundError"]


class NotFoundError(ContractError):
    reason = "not_found"


class ConflictError(ContractError):
    reason = "conflict"


class AuthError(ContractError):
    reason = "unauthorized"


class ForbiddenError(ContractError):
    reason = "forbidden"
