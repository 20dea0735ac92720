"""Alembic migrations of the cloud store (run by ``cloud_service.db.upgrade_database``)."""
