"""Test JPEGs: a progressive JPEG split into its scans, and a "scan bomb" built from it."""

from __future__ import annotations

from simulations.samples import progressive_jpeg, scan_bomb

__all__ = ["progressive_jpeg", "scan_bomb"]
