"""tf.data-style input pipelines over grain: ``Dataset``, ``Options`` and constants.

``Dataset`` has ``tf.data.Dataset``'s names and semantics (TensorFlow 2.21),
yields numpy values, and runs on grain. ``TextLineDataset``,
``NumpyFileDataset`` and ``ArrayRecordDataset`` read files (split by file
between workers under ``AutoShardPolicy.FILE``). A ``tf.data.Dataset`` or a
grain ``MapDataset``/``IterDataset`` is accepted wherever a ``Dataset`` is.

Keras ``fit``/``evaluate``/``predict`` read a ``Dataset`` even when no strategy
exists (``keras_adapter.py``, installed when the first ``Dataset`` is built).
"""

from distribute.data import experimental
from distribute.data._files import array_record_dataset as ArrayRecordDataset
from distribute.data._files import numpy_file_dataset as NumpyFileDataset
from distribute.data._files import text_line_dataset as TextLineDataset
from distribute.data._spec import TensorSpec
from distribute.data.dataset import Dataset, DatasetIterator
from distribute.data.options import (
    AUTOTUNE,
    INFINITE_CARDINALITY,
    UNKNOWN_CARDINALITY,
    AutoShardPolicy,
    DistributeOptions,
    Options,
)

__all__ = [
    "AUTOTUNE",
    "INFINITE_CARDINALITY",
    "UNKNOWN_CARDINALITY",
    "ArrayRecordDataset",
    "AutoShardPolicy",
    "Dataset",
    "DatasetIterator",
    "DistributeOptions",
    "NumpyFileDataset",
    "Options",
    "TensorSpec",
    "TextLineDataset",
    "experimental",
]
