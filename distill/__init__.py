"""EdgeLoop distill."""
