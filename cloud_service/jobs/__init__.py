"""Distillation jobs in the cloud: the queue with leases (``queue``), schedules and
triggers (``schedules``), their tables (``tables``), the worker (``worker``) and the
job itself (``runner``: snapshot, distillation in ``distill``, gate, delivery).
See docs/architecture.md.
"""
