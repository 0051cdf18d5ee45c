"""Per-rank state files beside a framework's checkpoint (Lightning, the Hugging Face Trainer,
Accelerate), which keep rank 0's state only: loading them on the same or another number of ranks.

Each file is a dict that :func:`torch.save` wrote on one rank, with ``world_size`` (the number
of ranks that saved) and that rank's model, optimizer and hook state. On the number of ranks
that saved them, every rank loads its own file, bitwise. On another number, every rank reads
every old file, one at a time, and gets the state that docs/algorithm.md section 10 makes of
them (:func:`slamb_comm.methods.resize.resize`: what is equal on every old rank kept, the moments, error
buffers and parameters averaged in float64), as :func:`slamb_comm.methods.checkpoint.load` does. Every
rank computes the same means, so nothing is communicated.
"""

import logging
import os
import warnings

import torch

from slamb_comm.methods.resize import resize

__all__ = ["load_rank_file", "resume_state"]

_log = logging.getLogger("slamb_comm")

_META = ("world_size", "rank")  # what a file says about the rank that wrote it: not state


def _read(path):
    return torch.load(path, map_location="cpu", weights_only=False)  # slamb_comm's own per-rank files


def load_rank_file(path_of, world, rank):
    """This rank's state from the per-rank files ``path_of(r)`` of old ranks r = 0 .. P-1.

    Returns ``(state, note)``: ``state`` is the file's dict (its own file when P == ``world``,
    else the resized state of new rank ``rank`` of ``world``) and ``note`` None or, for a
    resize, what was done; or ``(None, problem)`` when there is nothing to load (no file for
    this rank nor for rank 0, an old rank's file missing, files of differing world sizes), and
    the caller warns and goes on from rank 0's state.
    """
    mine = path_of(rank)
    if os.path.exists(mine):
        first = (rank, _read(mine))
        if first[1].get("world_size") == world:
            return first[1], None
    elif os.path.exists(path_of(0)):
        first = (0, _read(path_of(0)))
    else:
        return None, f"no per-rank state file {mine}"
    old = first[1].get("world_size")
    if not isinstance(old, int) or old < 1:
        return None, f"{path_of(first[0])} does not say how many ranks saved it"
    paths = [path_of(r) for r in range(old)]
    missing = [p for p in paths if not os.path.exists(p)]
    if missing:
        return None, f"saved at {old} ranks, but {missing[0]} is missing"

    def states():  # one old file at a time; the one read above is not read again
        for r, p in enumerate(paths):
            s = first[1] if r == first[0] else _read(p)
            if s.get("world_size") != old:
                raise ValueError(f"{p} was saved at {s.get('world_size')} ranks, {paths[0]} at {old}: "
                                 "per-rank files of different checkpoints; save again")
            yield {k: v for k, v in s.items() if k not in _META}

    state, report = resize(states(), world, rank, old_size=old)
    state["world_size"] = world
    return state, (f"per-rank state of {old} ranks resized for rank {rank} of {world} (docs/algorithm.md "
                   f"section 10): {report['kept']} entries kept, {len(report['averaged'])} averaged")


def resume_state(path_of, world, rank, where):
    """What a framework's resume loads on this rank: :func:`load_rank_file`'s state (a resize
    logged on logger ``slamb_comm``), or None with a warning that every rank goes on from rank
    0's state (the framework's own checkpoint). ``where`` names the checkpoint in the messages."""
    state, note = load_rank_file(path_of, world, rank)
    if state is None:
        warnings.warn(f"slamb_comm: {note}: every rank resumes from rank 0's model and optimizer state (a valid "
                      "run, but not the interrupted one: SLAMB's moments and top-k's error buffers are per rank; "
                      "see docs/integrations.md)", stacklevel=3)
    elif note is not None:
        _log.info("slamb_comm: %s: %s", where, note)
    return state
