"""The engine's parts for steps that cannot be one SPMD program (the exact uneven step).

``per_replica.py``: each replica's function traced once per replica shape and cut
at its collectives into programs, the collectives made on the host between them
(``host.py``); ``threads.py``: the eager fallback, one thread per replica meeting
at every collective; ``context.py``: what their replica contexts share.
``uneven.py`` chooses between them for ``strategy.run`` and Keras ``fit``.
"""
