"""API routes, one module per noun."""
