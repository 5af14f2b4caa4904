"""Jobs: specs, queue and policies, gang and topology-aware placement, executors, server loop, simulator."""
