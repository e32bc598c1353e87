"""The coordinator: job registry, placement, call queues and the scheduler."""
