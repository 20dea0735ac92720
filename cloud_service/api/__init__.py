"""The REST API: ``create_app(settings)`` builds the FastAPI application."""

from cloud_service.api.app import ApiState, create_app

__all__ = ["ApiState", "create_app"]
