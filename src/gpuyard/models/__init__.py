"""Model management: tracking, evaluation and cross-validation, search, registry, optimization, retraining."""
