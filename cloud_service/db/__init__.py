"""The cloud's SQL store: models, engine/session helpers, migrations, and crud functions."""

from cloud_service.db.models import (
    Agent,
    Base,
    DeadLetter,
    EnrollmentToken,
    Label,
    Sample,
    SampleStatus,
    Verdict,
)
from cloud_service.db.session import make_engine, make_session_factory, upgrade_database

__all__ = [
    "Agent",
    "Base",
    "DeadLetter",
    "EnrollmentToken",
    "Label",
    "Sample",
    "SampleStatus",
    "Verdict",
    "make_engine",
    "make_session_factory",
    "upgrade_database",
]
