"""What one API request may carry: id and offset ranges, string lengths, the body cap and its timeout.

Every bound is checked at the edge, before any library call, so an out-of-range value is a 422 that
names the field (or a 413/408 for the body), never an overflow deep in SQLite, ``seek`` or
``timedelta``. The FastAPI parameter types that carry them are in :mod:`gpuyard.api.params`; this
module imports nothing, so the CLI reads its defaults cheaply. The job spec's own bounds (command,
environment, resources) live with the spec in :mod:`gpuyard.scheduler.spec`: YAML files get them too.
"""

from __future__ import annotations

# Ids are INTEGER columns: 32-bit signed on PostgreSQL, so the smaller of the two stores' ranges.
MAX_ID = 2**31 - 1
# A byte offset into a log: exact as a JSON number in a browser (2**53), far past any real file.
MAX_OFFSET = 2**53 - 1
# Names of jobs, teams and users (NAME_PATTERN); models, experiments and datasets allow 200 in the store.
NAME_LEN = 100
REF_LEN = 200
# An artifact's name as recorded (RunArtifactRow.name is String(300)).
ARTIFACT_NAME_LEN = 300
# A filter value such as a state or a run kind.
WORD_LEN = 32

# The request body: a job spec carries at most MAX_COMMAND_CHARS of argv and environment (about 1 MiB);
# JSON escapes can double or more that, so 4 MiB leaves room without letting a body grow unbounded.
DEFAULT_MAX_BODY_BYTES = 4 * 1024 * 1024
# A body must have arrived this long after the request started: a slow sender is cut off with 408.
DEFAULT_BODY_TIMEOUT_S = 30.0

# Connections (gpuyard.connections): a request's headers must arrive within this many seconds of
# the connection opening (or of its previous response); open connections served as usual without a
# token in total and per client address; how many more are let in (probes, admins, teams under their
# share); connections of one team; requests of one team (or address) in flight at once, under the 40
# worker threads FastAPI's routes run in, so one team never holds them all.
DEFAULT_HEADER_TIMEOUT_S = 10.0
DEFAULT_MAX_CONNECTIONS = 4096
DEFAULT_MAX_PER_ADDRESS = 512
DEFAULT_RESERVE = 64
DEFAULT_MAX_PER_TEAM = 512
DEFAULT_MAX_REQUESTS_PER_TEAM = 24
