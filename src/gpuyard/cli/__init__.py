"""Command line: `gpuyard <noun> <verb>`; one module per noun, each with a ``register(app)`` function."""
