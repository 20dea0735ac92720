"""Plain functions over a Session, keyword-only; routes and workers call these, nothing else.

Modules: ``ingest`` (samples, verdicts, dead letters, agent and model status; idempotent
batch inserts), ``enrollment`` (one-time tokens, API tokens), ``queries`` (listing and
reading, labels, counts), ``users`` (the review UI's users).
"""

from __future__ import annotations

from cloud_service.db.crud.enrollment import (
    ENROLL_RETRY_S,
    agent_for_api_token,
    create_enrollment_token,
    enroll_agent,
    hash_token,
)
from cloud_service.db.crud.ingest import (
    COLLISION_ATTEMPTS,
    SampleKey,
    colliding_sample_id,
    get_verdicts,
    image_keys_under,
    insert_dead_letters,
    insert_samples,
    insert_verdicts,
    pending_samples,
    record_agent_status,
    record_model_status,
    store_samples,
)
from cloud_service.db.crud.queries import (
    add_label,
    get_sample,
    list_agents,
    list_dead_letters,
    list_samples,
    list_verdicts,
    stats,
)
from cloud_service.db.crud.users import (
    authenticate_user,
    create_user,
    get_user,
    list_users,
    set_password,
)

__all__ = [
    "COLLISION_ATTEMPTS",
    "ENROLL_RETRY_S",
    "SampleKey",
    "add_label",
    "agent_for_api_token",
    "authenticate_user",
    "colliding_sample_id",
    "create_enrollment_token",
    "create_user",
    "enroll_agent",
    "get_sample",
    "get_user",
    "get_verdicts",
    "hash_token",
    "image_keys_under",
    "insert_dead_letters",
    "insert_samples",
    "insert_verdicts",
    "list_agents",
    "list_dead_letters",
    "list_samples",
    "list_users",
    "list_verdicts",
    "pending_samples",
    "record_agent_status",
    "record_model_status",
    "set_password",
    "stats",
    "store_samples",
]
