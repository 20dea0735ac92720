"""EdgeLoop simulations."""
