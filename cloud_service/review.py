"""Review rules: which verified samples a human should look at, and why."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

__all__ = ["ReviewRules"]


@dataclass(frozen=True)
class ReviewRules:
    """Flag a sample when the teacher is unsure, edge and teacher disagree, or for audit."""

    confidence_below: float = 0.5
    on_disagreement: bool = True
    audit_share: float = 0.02

    def reasons(
        self, *, sample_id: str, teacher_confidence: float, agrees_with_edge: bool
    ) -> list[str]:
        """The reasons to review this sample (empty: no review)."""
        reasons = []
        if teacher_confidence < self.confidence_below:
            reasons.append("teacher_unsure")
        if self.on_disagreement and not agrees_with_edge:
            reasons.append("disagreement")
        if self.audit_share > 0 and _audit_draw(sample_id) < self.audit_share:
            reasons.append("audit")
        return reasons


def _audit_draw(sample_id: str) -> float:
    """A uniform draw in [0, 1) fixed by the sample id.

    Derived from the id rather than a random generator so a sample verified twice
    (redelivery, a restarted verifier) gets the same decision.
    """
    digest = hashlib.blake2b(sample_id.encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") / 2**64
