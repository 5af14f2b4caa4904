"""The security tier: attacks a member could try, each expected to be refused.

The servers and their fixtures are the scheduler integration tests' own (real `gpuyard server`
processes on 127.0.0.1); tests that run jobs as other Unix users need root (CI has it).
"""

from tests.integration.scheduler.conftest import server  # noqa: F401 - a fixture, used by name
