"""EdgeLoop cloud_service."""
