"""GPU tests: marked ``gpu``, skipped without CUDA. The marker is registered here too, so
``--strict-markers`` holds before pyproject lists it."""

import pytest


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "gpu: needs an NVIDIA GPU (CUDA); skipped without one")
