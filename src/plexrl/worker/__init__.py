"""A worker: the engine that executes jobs' calls, and its samplers and trainers."""
