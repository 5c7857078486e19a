"""The continuous-admission policy's decisions (rollout.admission=continuous), as pure functions of
counts and versions: the engine (runtime/rollout/continuous.ContinuousRollouts over sampling/sampler.Sampler)
and the cost model's event simulation of it (costmodel/lengths.admission) both decide with these, so
the simulation prices what the engine does (tests/test_admission_parity.py drives both on the same
seeded lengths and compares their decisions step by step).

The policy, per RL step t with staleness bound k:

1. Stale groups: a group whose oldest token has version < t - k can no longer enter a batch; the
   completed ones (in completion order), then the ones in flight (in submission order), are
   re-queued (generated again from their prompt, before any new prompt) or dropped (the next prompt
   of the stream takes their place), as rollout.stale_groups says.
2. Top-up: whole groups are queued while the sequences not yet finished fit in the slots
   (`wants_group`): every slot is busy and one group waits for the next to free.
3. Admission: waiting groups enter FIFO while the first one fits in the free slots (`admits`).
4. The decode chunk runs up to chunk_steps steps (cut where the page-table width would grow,
   shapes/buckets.TableWidths.align) and ends early once the first waiting group's worth of slots
   has freed after at least min_chunk_steps (`release_rule`, run on the device by
   sampling/engine.decode_chunk; `chunk_length` is its closed form given the remaining lengths).
5. Completed groups join the done list in submission order within a chunk; the step's batch is
   the first groups_per_step of them (`take_batch`), the rest wait for the next step.
"""

from __future__ import annotations

import numpy as np


def fresh_enough(oldest_version: int | None, step: int, staleness: int) -> bool:
    """May a group whose oldest token has `oldest_version` (None: no token yet) enter step `step`'s
    batch under the bound k = `staleness`."""
    return oldest_version is None or oldest_version >= step - staleness


def wants_group(unfinished: int, max_slots: int) -> bool:
    """Top-up: queue another whole group while the sequences not finished (running or waiting) fit
    in the slots, so that every slot is busy and one group waits."""
    return unfinished <= max_slots


def admits(group_size: int, free_slots: int) -> bool:
    """FIFO admission: the first waiting group enters when all its sequences find a free slot."""
    return group_size <= free_slots


def release_rule(release_slots: bool, waiting: list[int], min_chunk_steps: int, max_slots: int) -> tuple[int, int]:
    """(minimum steps, slots freed) after which the decode chunk ends early: with release_slots
    (continuous admission) and a group waiting (`waiting`: the waiting groups' sizes, FIFO), once
    the first waiting group's size of slots has freed after min_chunk_steps; else never (more slots
    than there are)."""
    if release_slots and waiting:
        return int(min_chunk_steps), int(waiting[0])
    return 0, int(max_slots) + 1


def chunk_length(remaining, k: int, rule: tuple[int, int]) -> int:
    """Steps a decode chunk of at most k steps runs when the busy slots have `remaining` steps left
    each, under release_rule's (min steps, slots): the first step >= min steps after which that many
    slots have freed, else k."""
    rem = np.asarray(remaining)
    min_steps, n = rule
    if n > rem.size:
        return int(k)
    nth = int(np.partition(rem, n - 1)[n - 1])
    return int(min(k, max(min_steps, nth)))


def take_batch(done: list, groups: int) -> tuple[list, list]:
    """(the step's batch, the completed groups left for the next step)."""
    return done[:groups], done[groups:]
