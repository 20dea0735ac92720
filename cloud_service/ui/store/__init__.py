"""What the review UI reads and writes: the queue, reviews with undo, export rows, charts.

Keyword-only functions over a Session, like ``cloud_service.db.crud``; the UI's
routes call these and nothing else touches the database for them.

Modules: ``classes`` (class names per model version), ``queue`` (the filter, pages,
neighbours), ``reviews`` (review, bulk review, undo; optimistic review tokens),
``reports`` (export rows, the dashboard's series).
"""

from __future__ import annotations

from cloud_service.ui.store.classes import ClassNames, class_names_for, model_file_labels
from cloud_service.ui.store.queue import (
    MAX_BULK,
    PAGE_SIZES,
    ROUTE_REASONS,
    SAMPLE_STATUSES,
    SORTS,
    STATUSES,
    QueueFilter,
    QueuePage,
    neighbour,
    queue_page,
)
from cloud_service.ui.store.reports import dashboard_series, export_rows
from cloud_service.ui.store.reviews import (
    BulkResult,
    ReviewResult,
    bulk_review,
    review_sample,
    review_token,
    sample_view,
    undo_bulk,
    undo_review,
)

__all__ = [
    "MAX_BULK",
    "PAGE_SIZES",
    "ROUTE_REASONS",
    "SAMPLE_STATUSES",
    "SORTS",
    "STATUSES",
    "BulkResult",
    "ClassNames",
    "QueueFilter",
    "QueuePage",
    "ReviewResult",
    "bulk_review",
    "class_names_for",
    "dashboard_series",
    "export_rows",
    "model_file_labels",
    "neighbour",
    "queue_page",
    "review_sample",
    "review_token",
    "sample_view",
    "undo_bulk",
    "undo_review",
]
