"""EdgeLoop shared."""
