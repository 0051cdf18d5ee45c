"""Checkpoints of every rank's state in one directory, written atomically.

:func:`save` is collective: each rank writes its own state (any picklable object: the
dicts of :meth:`SlambRule.state_dict`, :meth:`Communicator.state_dict`, a torch
``state_dict``...) into a fresh temporary directory next to the target; rank 0 then
writes a manifest with the world size and a SHA-256 of every rank's file, and renames
the temporary directory into place. A save killed halfway leaves only a temporary
directory (ignored) and the previous checkpoint untouched, so a half-written
checkpoint is never mistaken for a good one.

:func:`load` is collective too: every rank checks the manifest, the world size and its
own file's hash, and all ranks raise :class:`CheckpointError` together if any rank finds
a problem.

SLAMB's state is per rank (each rank's own momentum, second moment and error buffers). On the
same number of ranks each rank gets its own state back, bitwise. On another number (a job that
lost or gained workers) every rank reads every old rank's file and :func:`slamb_comm.methods.resize.resize`
makes its state by docs/algorithm.md section 10's rule: what is equal on every rank kept,
per-rank floating-point state (moments, error buffers, parameters between syncs) averaged,
1-bit LAMB's server errors re-chunked; logged. ``resize=False`` refuses instead.

The directory must be on a file system that every rank sees (or, on one machine, any
local directory). Files are pickles: load only checkpoints you wrote.
"""

import hashlib
import json
import os
import pickle
import shutil

import numpy as np

from . import resize as _resize
from ..errors import SlambCommError

__all__ = ["CheckpointError", "save", "load"]

_MANIFEST = "MANIFEST.json"
_FORMAT = 1


class CheckpointError(SlambCommError):
    """A checkpoint is missing, incomplete, corrupt, or made for another number of ranks."""


def _rank_file(rank):
    return f"rank{rank:05d}.pkl"


def _agree(transport, ok, message):
    """Raise on every rank if any rank's ``ok`` is false."""
    mine = np.array([0 if ok else 1], dtype=np.int32)
    everyone = np.zeros(transport.size, dtype=np.int32)
    transport.allgather(mine, everyone)
    bad = [r for r in range(transport.size) if everyone[r]]
    if not ok:
        raise CheckpointError(message)
    if bad:
        raise CheckpointError(f"rank(s) {bad} failed: see their error")


def save(directory, state, transport, meta=None):
    """Write this rank's ``state`` into checkpoint ``directory`` (collective; atomic).

    Args:
        directory: the checkpoint's path; an existing checkpoint there is replaced only
            once the new one is complete.
        state: this rank's picklable state.
        transport: the transport of the job (its rank and size name the files).
        meta: optional JSON-serialisable dict stored in the manifest by rank 0.
    """
    directory = os.path.abspath(directory)
    parent = os.path.dirname(directory)
    token = np.array([int.from_bytes(os.urandom(7), "little")], dtype=np.int64)
    transport.broadcast(token, root=0)
    tmp = f"{directory}.tmp-{int(token[0]):x}"
    error = None
    if transport.rank == 0:
        try:
            os.makedirs(parent, exist_ok=True)
            os.makedirs(tmp)
        except OSError as e:
            error = e
    _agree(transport, error is None, f"cannot create {tmp}: {error}")
    digest = bytes(32)
    try:
        path = os.path.join(tmp, _rank_file(transport.rank))
        data = pickle.dumps(state, protocol=pickle.HIGHEST_PROTOCOL)
        with open(path, "wb") as fh:
            fh.write(data)
            fh.flush()
            os.fsync(fh.fileno())
        digest = hashlib.sha256(data).digest()
    except Exception as e:  # noqa: BLE001 - reported collectively below
        error = e
    _agree(transport, error is None, f"rank {transport.rank} could not write its state: {error!r}")
    everyone = np.zeros(32 * transport.size, dtype=np.uint8)
    transport.allgather(np.frombuffer(digest, dtype=np.uint8).copy(), everyone)
    if transport.rank == 0:
        try:
            files = {_rank_file(r): bytes(everyone[32 * r : 32 * (r + 1)]).hex() for r in range(transport.size)}
            _complete(directory, tmp, f"{int(token[0]):x}", files, transport.size, meta)
        except Exception as e:  # noqa: BLE001
            error = e
    _agree(transport, error is None, f"rank 0 could not complete the checkpoint: {error!r}")


def _complete(directory, tmp, tag, files, world_size, meta):
    """Rank 0: write the manifest (``files``: name -> sha256) into ``tmp`` and put ``tmp`` in
    place of ``directory`` (the old checkpoint, if any, is removed only after)."""
    manifest = {"format": _FORMAT, "world_size": world_size, "files": files, "meta": meta or {}}
    with open(os.path.join(tmp, _MANIFEST), "w") as fh:
        json.dump(manifest, fh, indent=1)
        fh.flush()
        os.fsync(fh.fileno())
    old = None
    if os.path.exists(directory):
        old = f"{directory}.old-{tag}"
        os.rename(directory, old)
    os.rename(tmp, directory)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def _read(directory, manifest, rank):
    name = _rank_file(rank)
    with open(os.path.join(directory, name), "rb") as fh:
        data = fh.read()
    if hashlib.sha256(data).hexdigest() != manifest["files"].get(name):
        raise CheckpointError(f"{directory}/{name} is corrupt (SHA-256 differs from the manifest)")
    return pickle.loads(data)


def load(directory, transport, resize=True):
    """Read this rank's state from checkpoint ``directory`` (collective).

    Written by as many ranks as this job has: this rank's own state, bitwise. Written by
    another number: with ``resize`` (default) this rank's state made from every old rank's by
    :func:`slamb_comm.methods.resize.resize` (docs/algorithm.md section 10; every rank reads every old
    rank's file, one at a time, and checks its hash); without, CheckpointError.

    Raises:
        CheckpointError: on every rank, if the checkpoint is missing or incomplete (no
            manifest), a file's hash differs, the old ranks' states differ in structure, or it
            was written by another number of ranks and ``resize`` is false.
    """
    directory = os.path.abspath(directory)
    state, error = None, None
    try:
        mpath = os.path.join(directory, _MANIFEST)
        if not os.path.exists(mpath):
            raise CheckpointError(f"{directory} is not a complete checkpoint (no {_MANIFEST})")
        with open(mpath) as fh:
            manifest = json.load(fh)
        if manifest.get("format") != _FORMAT:
            raise CheckpointError(f"{directory}: unknown checkpoint format {manifest.get('format')!r}")
        old = int(manifest["world_size"])
        if old == transport.size:
            state = _read(directory, manifest, transport.rank)
        elif not resize:
            raise CheckpointError(
                f"{directory} was written by {old} ranks, this job has {transport.size}, and resize=False: "
                "SLAMB's state is per rank; pass resize=True to average it for the new number of ranks "
                "(docs/algorithm.md section 10)")
        else:
            try:
                state, _ = _resize.resize((_read(directory, manifest, r) for r in range(old)), transport.size,
                                          transport.rank, old_size=old)
            except ValueError as e:
                raise CheckpointError(f"{directory}: cannot resize from {old} to {transport.size} ranks: {e}") from e
    except CheckpointError as e:
        error = e
    except Exception as e:  # noqa: BLE001
        error = CheckpointError(f"rank {transport.rank} could not read {directory}: {e!r}")
    _agree(transport, error is None, str(error))
    return state
