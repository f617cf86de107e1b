"""``tf.data.experimental``'s names that distributed programs use: ``distribute.data.experimental``.

``AutoShardPolicy``, ``DistributeOptions``, ``AUTOTUNE``, ``INFINITE_CARDINALITY``
and ``UNKNOWN_CARDINALITY`` are the same objects as in ``distribute.data``, so a
program ported by substitution (``tf.data`` -> ``distribute.data``) runs as is.
"""

from distribute.data.options import (
    AUTOTUNE,
    INFINITE_CARDINALITY,
    UNKNOWN_CARDINALITY,
    AutoShardPolicy,
    DistributeOptions,
)

__all__ = ["AUTOTUNE", "INFINITE_CARDINALITY", "UNKNOWN_CARDINALITY", "AutoShardPolicy", "DistributeOptions"]
