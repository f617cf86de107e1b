"""The Ray actors: ``ParameterServer`` (holds variable shards, applies updates) and ``Worker``.

Neither imports Keras or user model code.  Workers run programs the coordinator
traced and serialized with ``jax.export``; the only user Python they run is a
``dataset_fn``.  Plans (which variables to pull, where each output goes) are
plain data built by ``program.py``.

A worker reaches its ps through a direct channel (``channel.py``: a step's
reads and updates, arrays as raw bytes; Ray carries everything else).  A ps
applies each update as it arrives, one at a time (a lock covers its channel
requests and its Ray methods, so an update is atomic): optimizer updates run
the exported apply program on the ps's *current* values and optimizer state;
``deltas`` are added (exact totals under asynchrony); ``sets`` overwrite (last
writer wins).

Every update carries the id of its closure, and a ps applies each closure's
update at most once.  One ps decides for each closure (its id mod the ps count).
A push to it alone is one update; a push that spans several ps goes in three
steps: the other ps keep their parts (``stage``), the deciding ps decides (the
first attempt of the closure to reach it wins) and applies its part, the others
apply the decided attempt's part (``commit``).  A worker that dies while pushing
has reached some ps and not others; the closure runs again elsewhere (TF's
at-least-once) on another batch, and a dead worker's requests may still arrive
late.  The re-run gets the decided attempt back and completes it; undecided
parts are dropped.  So every scheduled step is applied exactly once, all its
variables from the same run (the same batch), where TF can apply a re-run step
twice to some variables and once to others.

One exchange with each ps per step (three rounds where the update spans several ps).  Each ps counts its mutations (``version``:
applied updates and coordinator writes).  A push asks its ps for the values its step read
(``read_back``), taken right after the update; the worker keeps them and its next
step reads them instead of pulling, if they are at least as new as every version
the coordinator had observed when it sent that step (results of finished
closures, its own writes; ``seen``).  So a step sees its worker's previous update,
everything the coordinator had seen happen before it scheduled the step, and
(with 1 worker) exactly the values a fresh read would return; other workers'
updates that landed after that read-back, unobserved, are missed, as TF misses
updates that land after its step's reads.  The coordinator sends a step's plan
and the worker sends an apply program to a ps (through Ray) only the first time.
"""
from __future__ import annotations

from distribute.parameter_server.actor_common import LOST
from distribute.parameter_server.ps_actor import ParameterServer
from distribute.parameter_server.worker_actor import Worker, _Iterator

__all__ = ["LOST", "ParameterServer", "Worker", "_Iterator"]
