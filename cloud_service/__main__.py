"""``python -m cloud_service``: the same as the ``cloud-service`` command."""

from cloud_service.cli import app

app(prog_name="cloud-service")
