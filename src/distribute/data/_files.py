"""File sources: ``list_files`` and readers of text, ``.npy``/``.npz`` and ArrayRecord shards.

A file-based dataset remembers its dataset of file names (its *files root*)
and how it was derived from it (``_more.recorded``), so
``AutoShardPolicy.FILE`` can rebuild the pipeline over this worker's files
only: ``shard_by_files(dataset, 2, 1)`` reads files 1, 3, ... of the (possibly
shuffled) name list, as TF's FILE auto-sharding does.
"""

from __future__ import annotations

import glob
import os
from typing import Any

import numpy as np

import distribute.data._kind as _kind
import distribute.data._spec as _spec


def list_files(cls: Any, file_pattern: Any, shuffle: bool | None, seed: int | None) -> Any:
    """``Dataset.list_files``: the sorted matches, shuffled unless ``shuffle=False``.

    Raises:
      TypeError: the pattern is not a str (or list of str).
      ValueError: nothing matches.
    """
    patterns = [file_pattern] if isinstance(file_pattern, (str, bytes, os.PathLike)) else list(file_pattern)
    names: list[str] = []
    for pattern in patterns:
        if not isinstance(pattern, (str, bytes, os.PathLike)):
            raise TypeError(f"list_files(): file_pattern entries must be str, got {type(pattern).__name__} "
                            f"({pattern!r}).")
        names.extend(glob.glob(os.fsdecode(pattern)))
    if not names:
        raise ValueError(f"list_files(): no files match {file_pattern!r}; check the pattern and the working "
                         "directory (tf.data raises InvalidArgumentError here).")
    dataset = _names_dataset(cls, sorted(set(names)))
    if shuffle is None or shuffle:
        dataset = dataset.shuffle(len(names), seed=seed)
    dataset._files_root, dataset._recipe = dataset, None
    return dataset


def _names_dataset(cls: Any, names: list[str]) -> Any:
    array = np.array([os.fsencode(n) for n in names], dtype=bytes)
    dataset = cls.from_tensor_slices(array)
    dataset._files_root = dataset
    return dataset


def filenames_dataset(filenames: Any, what: str) -> Any:
    """``filenames`` (a str, a list of str or a Dataset of names) as a dataset of names and files root.

    Raises:
      TypeError: anything else.
    """
    Dataset = _kind.dataset_class()

    if isinstance(filenames, Dataset):
        return filenames
    names = [filenames] if isinstance(filenames, (str, bytes, os.PathLike)) else list(filenames)
    if not names or not all(isinstance(n, (str, bytes, os.PathLike)) for n in names):
        raise TypeError(f"{what}: filenames={filenames!r} must be a file name, a non-empty list of them or a "
                        "Dataset of them (e.g. Dataset.list_files(pattern)).")
    return _names_dataset(Dataset, [os.fsdecode(n) for n in names])


def text_line_dataset(filenames: Any, compression_type: Any = None, buffer_size: Any = None,
                      num_parallel_reads: Any = None, name: str | None = None) -> Any:
    """The lines of text files, as bytes without the line ending (``tf.data.TextLineDataset``).

    Files are read one after another, in order. Only uncompressed files are read.

    Raises:
      TypeError: bad ``filenames``; NotImplementedError: a compression type was given.
    """
    if compression_type not in (None, ""):
        raise NotImplementedError(f"TextLineDataset(compression_type={compression_type!r}): compressed files are "
                                  "not supported; decompress them first.")
    names = filenames_dataset(filenames, "TextLineDataset()")
    return names._read_files(_text_lines, _spec.TensorSpec((), _spec.STRING))


def _text_lines(name: Any) -> Any:
    Dataset = _kind.dataset_class()

    with open(os.fsdecode(bytes(name)), "rb") as handle:
        lines = [line.rstrip(b"\r\n") for line in handle]
    return Dataset.from_tensor_slices(np.array(lines, dtype=bytes) if lines else np.zeros(0, dtype="S1"))


def numpy_file_dataset(filenames: Any) -> Any:
    """The rows (dim 0) of ``.npy`` files, or of every array of ``.npz`` files as dict elements.

    ``.npy`` files are memory-mapped, so a row is read from disk when it is
    used. Every file must hold arrays of one dtype and row shape (the first
    file's set the element_spec).

    Raises:
      TypeError: bad ``filenames``; ValueError: a file is neither ``.npy`` nor ``.npz``.
    """
    names = filenames_dataset(filenames, "NumpyFileDataset()")
    first = next(iter(_first_names(names)), None)
    spec = None if first is None else _numpy_file(first).element_spec
    return names._read_files(_numpy_file, spec)


def _first_names(names: Any) -> list[bytes]:
    import distribute.data._plan as _plan

    with _plan.peeking():
        for name in names:
            return [bytes(name)]
    return []


def _numpy_file(name: Any) -> Any:
    Dataset = _kind.dataset_class()

    path = os.fsdecode(bytes(name))
    if path.endswith(".npy"):
        return Dataset.from_tensor_slices(np.load(path, mmap_mode="r"))
    if path.endswith(".npz"):
        with np.load(path) as archive:
            return Dataset.from_tensor_slices({key: archive[key] for key in archive.files})
    raise ValueError(f"NumpyFileDataset(): {path!r} is neither a .npy nor a .npz file; save arrays with "
                     "np.save / np.savez.")


def array_record_dataset(filenames: Any) -> Any:
    """The records of ArrayRecord files, as bytes scalars (read with grain's ArrayRecordDataSource).

    Raises:
      TypeError: bad ``filenames``.
    """
    names = filenames_dataset(filenames, "ArrayRecordDataset()")
    return names._read_files(_array_records, _spec.TensorSpec((), _spec.STRING))


def _array_records(name: Any) -> Any:
    import grain

    Dataset = _kind.dataset_class()

    source = grain.sources.ArrayRecordDataSource([os.fsdecode(bytes(name))])
    return Dataset.from_generator(lambda: (np.bytes_(source[i]) for i in range(len(source))),
                                  output_signature=_spec.TensorSpec((), _spec.STRING))


def shard_by_files(dataset: Any, num_shards: int, index: int) -> Any | None:
    """The pipeline rebuilt over files ``index, index + num_shards, ...`` of its files root.

    Returns None for a dataset that reads no files (or whose derivation was not recorded).

    Raises:
      ValueError: fewer files than shards (as TF's FILE auto-sharding).
    """
    root = dataset._files_root
    if root is None:
        return None
    num_files = root.cardinality()
    if 0 <= num_files < num_shards:
        raise ValueError(f"auto_shard_policy=FILE: the dataset reads {num_files} files, fewer than the "
                         f"{num_shards} workers, so some workers would read nothing. Use more files, or "
                         "AutoShardPolicy.DATA.")
    return _replay(dataset, root, root.shard(num_shards, index))


def _replay(dataset: Any, root: Any, new_root: Any) -> Any | None:
    if dataset is root:
        return new_root
    if dataset._recipe is None:
        return None
    parent, method, args, kwargs = dataset._recipe
    rebuilt = _replay(parent, root, new_root)
    return None if rebuilt is None else getattr(rebuilt, method)(*args, **kwargs)
