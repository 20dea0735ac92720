"""What the REST API, the review UI and the security layer share: the process state
and the FastAPI dependencies that hand it out (``docs/architecture.md``, "Layers")."""
