"""tf.data-style input pipelines over grain: ``Dataset``, ``Options`` and constants.

``Dataset`` has ``tf.data.Dataset``'s names and semantics (TensorFlow 2.21),
yields numpy values, and runs on grain.
"""

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
    "AutoShardPolicy",
    "Dataset",
    "DatasetIterator",
    "DistributeOptions",
    "Options",
]
