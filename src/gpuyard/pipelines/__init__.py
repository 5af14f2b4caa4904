"""Pipelines: data -> train/tune -> evaluate -> register -> deploy -> monitor, each stage a scheduled job.

- :mod:`gpuyard.pipelines.spec`: the YAML spec (stages, their inputs, references to earlier outputs).
- :mod:`gpuyard.pipelines.runner`: runs the stages in order as jobs of an in-process ``JobService``
  (or inline), skipping stages whose inputs did not change (:mod:`gpuyard.pipelines.cache`).
- :mod:`gpuyard.pipelines.stages`: the stage kinds, each a plain function over JSON.
"""
