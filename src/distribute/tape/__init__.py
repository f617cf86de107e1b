"""``distribute.GradientTape``: TF's tape for step functions that run as JAX programs.

``gradient_tape.py`` is the public class; ``_level.py`` records one run of a
step function; ``_replay.py`` runs it again as a JAX trace; ``_differentiate.py``
differentiates that trace as TF's tape would.
"""

from distribute.tape.gradient_tape import GradientTape, UnconnectedGradients

__all__ = ["GradientTape", "UnconnectedGradients"]
