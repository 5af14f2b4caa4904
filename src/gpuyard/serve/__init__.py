"""Inference: a model server with dynamic batching, deployments in the store, monitoring and drift."""
