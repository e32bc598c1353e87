"""The scheduler: a pure policy object. Events in, actions out; no I/O, no clock of its own.

The coordinator's server feeds it real events on real time; ``plexrl.sim`` feeds the same
object virtual events. Time (``now``) is an argument, ties are broken by submission order, so a
run replays exactly.

Its parts share one ``Tables`` (``state.py``: every worker, job and call record, by id) and each
owns one concern:

| module | what it decides |
|---|---|
| ``scheduler.py`` | ``Scheduler``: one method per event, each a few named steps over the parts |
| ``calls.py`` | a call's place in its job's order, its lane's queue, where the lane runs |
| ``dispatch.py`` | what a worker starts now, and what waits for a swap or an engine switch |
| ``swaps.py`` | moving a job's state between device and host memory, and whose goes |
| ``engines.py`` | when a worker's vLLM engines sleep for training and wake to sample |
| ``placement.py`` | a one-device job's home and sampler worker, sized by the memory plan |
| ``gangs.py`` | a group job's block of workers, and its calls run on all of them at once |
| ``elastic.py`` | idle rollout workers joining a pooled job's training at a step boundary, and leaving |
| ``pool.py`` | pooled jobs' turns on the rollout workers, their replicas, role moves |
| ``recovery.py`` | lost workers and jobs, restores and the scheduler's other calls of its own |

Invariants it keeps, whatever the policy:
- a job's calls run in two lanes: ``generate`` in its sampler lane, every other kind in its trainer
  lane, one call at a time and in submission order (generates may overlap, in priority order);
  a barrier (``open``, ``close``, ``sync_weights``, ``load``: they change what the sampler
  serves) waits for every earlier call of the job and holds back every later one;
- trainer-lane calls run on the job's home worker (affinity), and on the rollout workers that
  joined its training while they help (``elastic.py``: from one step boundary to another, a
  gang); the sampler lane runs there too,
  or, for a disaggregated job, on its sampler worker, or, for a pooled job, on the rollout
  workers: each turn in the bucket of its trajectory's level (``coordinator/buckets.py``), on
  the worker its trajectory's last turn ran on if that one has a free slot (its prefix cache);
  on the job's home while no rollout worker is registered. No job's home is a rollout worker;
- a worker runs at most ``slots`` calls at once, of them at most ``trainer_slots`` other than
  generates (a worker's trainer runs one call at a time, so the order of those is the policy's);
- a group job (``JobOpened.devices`` > 1) lives on an aligned block of workers of one node
  (``coordinator/groups.py``); its state, a shard on each member, swaps on all members together
  and counts against each member's budget; its calls run one at a time on all members at once
  (gang): a call starts only when every member has drained, and nothing else starts on a member
  from the moment the group claims it until that call ends; losing a member ends or re-homes the
  job as a unit;
- every call, submitted or its own (``OwnCall``: negative ids), ends in exactly one ``Dispatch``
  followed by the server's ``CallFinished``, or in one ``Fail``; a recoverable job's calls running
  on a lost worker go back to the front of their queues (dispatched again on its new home, after
  a ``restore`` of its own).
"""

from plexrl.coordinator.scheduler.scheduler import Scheduler
from plexrl.coordinator.scheduler.state import JobView

__all__ = ["JobView", "Scheduler"]
