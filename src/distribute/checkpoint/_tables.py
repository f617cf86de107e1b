"""Tables a checkpoint stores outside the coordinator: zarr arrays each ps writes and reads itself.

A variable the coordinator holds no value of (a large ParameterServerStrategy
variable, ``Placement.remote``) is not part of the orbax tree: each ps writes
the rows it holds, one zarr array per shard (``<tables dir>/<file>``, written
with tensorstore in chunks of about :data:`CHUNK_BYTES`), and the checkpoint's
record lists, per variable, its parts ``{"file", "start", "stop"}`` (rows of
axis 0).  The tables directory is ``tables/`` inside the checkpoint's own
orbax directory: the ps write it during orbax's save, into orbax's temporary
directory (``_storage._with_tables``), so orbax's commit (the rename) commits
the tables with the rest and a checkpoint is one directory; a save that fails
there (a ps lost) deletes the temporary directory and commits nothing, leaving
the previous checkpoint as it was.  Checkpoints of format 2 kept the tables in
a sibling ``<checkpoint>.tables-<time>``; they still restore.

A restore reads any rows from the parts (:func:`read_rows`): each ps its own
shards, for any number of ps or shards, or the whole value into a variable
without a strategy (:func:`TableRef.read`).
"""

from __future__ import annotations

from typing import Any

import numpy as np

CHUNK_BYTES = 16 << 20  # a zarr chunk (a file) holds about this many bytes of rows
_PIECE_BYTES = 64 << 20  # rows written or read at once


def _open(path: str, shape: tuple | None = None, dtype: Any = None) -> Any:
    import tensorstore as ts

    spec = {"driver": "zarr", "kvstore": {"driver": "file", "path": path}}
    if shape is None:
        return ts.open(spec, open=True).result()
    row_bytes = max(int(np.prod(shape[1:], dtype=np.int64)) * np.dtype(dtype).itemsize, 1)
    chunk = [max(1, min(int(shape[0]), CHUNK_BYTES // row_bytes)), *shape[1:]] if shape else []
    return ts.open(spec, create=True, delete_existing=True, dtype=np.dtype(dtype).name, shape=list(shape),
                   chunk_layout=ts.ChunkLayout(chunk_shape=chunk)).result()


def _pieces(length: int, row_bytes: int) -> list[tuple[int, int]]:
    per = max(1, _PIECE_BYTES // max(row_bytes, 1))
    return [(a, min(a + per, length)) for a in range(0, length, per)]


def write_array(path: str, value: np.ndarray) -> None:
    """Writes ``value`` as a zarr array at ``path``, in pieces of rows."""
    array = _open(path, tuple(value.shape), value.dtype)
    if value.ndim == 0:
        array.write(value).result()
        return
    row_bytes = value.nbytes // max(len(value), 1)
    for a, b in _pieces(len(value), row_bytes):
        array[a:b].write(value[a:b]).result()


def read_rows(directory: str, parts: list, start: int, out: np.ndarray) -> None:
    """Fills ``out`` with rows ``[start, start + len(out))`` of a table saved as ``parts``."""
    stop = start + len(out)
    for part in parts:
        a, b = max(start, part["start"]), min(stop, part["stop"])
        if a >= b:
            continue
        array = _open(f"{directory}/{part['file']}")
        row_bytes = out.nbytes // max(len(out), 1)
        for p, q in _pieces(b - a, row_bytes):
            out[a - start + p : a - start + q] = array[a - part["start"] + p : a - part["start"] + q].read().result()


class TableRef:
    """A saved table in a restore: its shape and dtype (for matching) and where its rows are."""

    def __init__(self, directory: str, entry: dict):
        self.directory, self.parts = directory, entry["table"]
        self.shape, self.dtype = tuple(entry["shape"]), np.dtype(entry["dtype"])

    @property
    def size(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64))

    def read(self) -> np.ndarray:
        """The whole value (a restore into a variable this process holds whole)."""
        out = np.empty(self.shape, self.dtype)
        read_rows(self.directory, self.parts, 0, out)
        return out

    def __array__(self, dtype: Any = None, copy: Any = None) -> np.ndarray:
        return np.asarray(self.read(), dtype=dtype)
