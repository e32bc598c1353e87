"""plexrl.sim: the coordinator's scheduler driven on virtual time by workload models."""

from plexrl.sim.driver import JobResult, SimResult, Simulation
from plexrl.sim.workload import JobModel, Lognormal

__all__ = ["JobModel", "JobResult", "Lognormal", "SimResult", "Simulation"]
