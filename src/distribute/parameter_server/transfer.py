"""Moving variable values between the coordinator and the ps, in messages of bounded size.

The coordinator sends initial values and its own assignments (``set_weights``,
a checkpoint restore) to the ps, and reads values back for its copies (a read
after ``join()``, a checkpoint save).  Every such Ray call carries at most
:data:`MAX_MESSAGE_BYTES` of values: small variables travel together, one call
per ps; a larger shard travels in row ranges of at most that size, written into
(or read from) its array in place, with at most :data:`_WINDOW` pieces in
flight.  So a table larger than any one message works, and the memory a
transfer takes beyond the value itself is a few pieces.

A remote variable (``registry.REMOTE_BYTES``) has no coordinator copy: it is
made on its ps (``create_from``), read whole only when the coordinator reads it
(``gather``, in pieces, kept by the caller only), and written in pieces.

After ``join()`` the coordinator's copies of small variables (up to
:data:`EAGER_REFRESH_BYTES` each) are refreshed at once; a larger one (an
embedding table) only when the coordinator reads it (``ParameterServerStrategyExtended._before_read``).
"""

from __future__ import annotations

from typing import Any

import numpy as np

# Values one Ray call carries at most (tests lower it to exercise the pieces).
MAX_MESSAGE_BYTES = 64 << 20
# After join(), copies of variables up to this size are refreshed together; larger ones when read.
EAGER_REFRESH_BYTES = 1 << 20
_WINDOW = 2  # pieces of one large shard in flight at once


def nbytes(var: Any) -> int:
    return int(np.prod(tuple(var.shape), dtype=np.int64)) * np.dtype(var.dtype).itemsize


def _pieces(length: int, row_bytes: int) -> list[tuple[int, int]]:
    per = max(1, MAX_MESSAGE_BYTES // max(row_bytes, 1))
    return [(a, min(a + per, length)) for a in range(0, length, per)] or [(0, 0)]


def push(cluster: Any, registry: Any, items: list) -> None:
    """Sends ``(entry, value)`` pairs to their ps; records the versions the ps report (``cluster.observe``)."""
    versions: dict[int, int] = {}
    batches: dict[int, dict] = {}
    sizes: dict[int, int] = {}

    def note(j: int, version: int) -> None:
        versions[j] = max(versions.get(j, 0), version)

    def send(j: int) -> None:
        note(j, cluster.get_from_ps([cluster.ps[j].create.remote(batches.pop(j))])[0])
        sizes.pop(j, None)

    for entry, value in items:
        value = np.asarray(value)
        for shard in entry.shards:
            rows = value if shard.start is None else value[shard.start : shard.stop]
            j = shard.ps
            if rows.nbytes > MAX_MESSAGE_BYTES and rows.ndim >= 1:
                _push_pieces(cluster, j, shard.key, rows, note)
                continue
            if j in batches and sizes[j] + rows.nbytes > MAX_MESSAGE_BYTES:
                send(j)
            batches.setdefault(j, {})[shard.key] = rows
            sizes[j] = sizes.get(j, 0) + rows.nbytes
    if batches:
        refs = {j: cluster.ps[j].create.remote(vals) for j, vals in batches.items()}
        for j, version in zip(refs, cluster.get_from_ps(list(refs.values()))):
            note(j, version)
    cluster.observe(versions)


def _push_pieces(cluster: Any, j: int, key: int, rows: np.ndarray, note: Any) -> None:
    row_bytes = rows.nbytes // max(len(rows), 1)
    pending: list = []
    for a, b in _pieces(len(rows), row_bytes):
        pending.append(cluster.ps[j].write_rows.remote(key, a, rows[a:b], tuple(rows.shape), rows.dtype.str))
        if len(pending) >= _WINDOW:
            note(j, cluster.get_from_ps([pending.pop(0)])[0])
    for version in cluster.get_from_ps(pending):
        note(j, version)


def pull(cluster: Any, registry: Any, entries: list) -> None:
    """Reads ``entries``' values from their ps into the coordinator's copies (clears their ``stale`` mark)."""
    if not entries:
        return
    small: dict[int, list] = {}  # ps -> keys read together
    large: list = []  # (entry, shard)
    for entry in entries:
        row_bytes = nbytes(entry.var) // max(int(tuple(entry.var.shape)[0]) if tuple(entry.var.shape) else 1, 1)
        for shard in entry.shards:
            length = (shard.stop - shard.start) if shard.start is not None else (
                int(tuple(entry.var.shape)[0]) if tuple(entry.var.shape) else 1)
            if length * row_bytes > MAX_MESSAGE_BYTES and tuple(entry.var.shape):
                large.append((entry, shard))
            else:
                small.setdefault(shard.ps, []).append(shard.key)
    large_keys = {shard.key for _, shard in large}
    values: dict = {}
    for j, keys in small.items():
        for batch in _batches(registry, keys, entries):
            values.update(cluster.get_from_ps([cluster.ps[j].read_all.remote(tuple(batch))])[0])
    for entry in entries:
        if not any(s.key in large_keys for s in entry.shards):
            registry.set_local(entry, registry.assemble(entry, values))
        else:
            out = np.empty(tuple(entry.var.shape), np.dtype(entry.var.dtype))
            for shard in entry.shards:
                start = shard.start or 0
                if shard.key in large_keys:
                    _pull_pieces(cluster, shard, out, start)
                else:
                    part = values[shard.key]
                    out[start : start + len(part)] = part
            registry.set_local(entry, out)
            del out
        entry.stale = False


def _batches(registry: Any, keys: list, entries: list) -> list:
    """``keys`` in groups of at most MAX_MESSAGE_BYTES of values."""
    size_of = {s.key: _shard_bytes(e, s) for e in entries for s in e.shards}
    out, current, total = [], [], 0
    for key in keys:
        if current and total + size_of[key] > MAX_MESSAGE_BYTES:
            out.append(current)
            current, total = [], 0
        current.append(key)
        total += size_of[key]
    return out + [current] if current else out


def _shard_bytes(entry: Any, shard: Any) -> int:
    if shard.start is None:
        return nbytes(entry.var)
    return nbytes(entry.var) // int(tuple(entry.var.shape)[0]) * (shard.stop - shard.start)


def _pull_pieces(cluster: Any, shard: Any, out: np.ndarray, offset: int) -> None:
    length = shard.stop - shard.start if shard.start is not None else len(out)
    row_bytes = out.nbytes // max(len(out), 1)
    pending: list = []
    for a, b in _pieces(length, row_bytes):
        pending.append((a, cluster.ps[shard.ps].peek.remote((shard.key,), a, b)))
        if len(pending) >= _WINDOW:
            a0, ref = pending.pop(0)
            part = cluster.get_from_ps([ref])[0][0]
            out[offset + a0 : offset + a0 + len(part)] = part
    for (a0, _), got in zip(pending, cluster.get_from_ps([ref for _, ref in pending])):
        out[offset + a0 : offset + a0 + len(got[0])] = got[0]


def gather(cluster: Any, entry: Any) -> np.ndarray:
    """A remote variable's whole value, read from its ps in pieces (the coordinator keeps no copy)."""
    out = np.empty(tuple(entry.var.shape), np.dtype(entry.var.dtype))
    for shard in entry.shards:
        _pull_pieces(cluster, shard, out, shard.start or 0)
    return out


def create_from(cluster: Any, entry: Any, spec: Any) -> None:
    """Makes a remote variable on its ps from its initializer's description (``initializers.make``)."""
    from distribute.parameter_server.initializers import shard_specs

    per_ps = shard_specs(spec, entry.shards, tuple(entry.var.shape), np.dtype(entry.var.dtype).name)
    refs = {j: cluster.ps[j].create_from.remote(specs) for j, specs in per_ps.items()}
    cluster.observe(dict(zip(refs, cluster.get_from_ps(list(refs.values())))))


def row_pieces(cluster: Any, entry: Any) -> Any:
    """Yields ``(first row, rows)`` of a remote variable, piece by piece from its ps (at most one piece held)."""
    shape = tuple(entry.var.shape)
    row_bytes = nbytes(entry.var) // max(shape[0], 1)
    for shard in entry.shards:
        offset, length = (0, shape[0]) if shard.start is None else (shard.start, shard.stop - shard.start)
        for a, b in _pieces(length, row_bytes):
            yield offset + a, cluster.get_from_ps([cluster.ps[shard.ps].peek.remote((shard.key,), a, b)])[0][0]
