"""EdgeLoop edge_agent."""
