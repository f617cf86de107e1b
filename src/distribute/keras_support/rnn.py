"""Keras recurrent layers (LSTM, GRU, SimpleRNN, ...) inside a replica program.

Keras' JAX backend runs a recurrent layer as ``lax.scan`` from zero initial
states. Inside the SPMD program a replica's rows differ from the others', so the
scan's carry comes out per replica ("varying" in ``shard_map``'s typing) while the
zeros it starts from are the same everywhere, and JAX refuses the scan ("scan body
function carry input and carry output must have equal types"): every RNN failed in
``strategy.run`` and in ``fit`` under any strategy. TF's replicas each run their own
loop, so the fix is to mark the initial states per replica too (``pcast`` to
varying), which changes no value. Outside a replica program nothing changes.
"""

from __future__ import annotations

from typing import Any, Callable

import jax

from distribute import _context

# backend function -> positions of its initial-state arguments
_STATE_ARGUMENTS = {"rnn": (2,), "lstm": (1, 2), "gru": (1,)}
_STATE_KEYWORDS = {"rnn": ("initial_states",), "lstm": ("initial_state_h", "initial_state_c"), "gru": ("initial_state",)}


def per_replica_states_of(name: str) -> Callable[[Callable], Callable]:
    """The ``Patch.wrap`` of backend function ``name`` (``rnn``, ``lstm`` or ``gru``)."""
    return lambda original: per_replica_states(original, _STATE_ARGUMENTS[name], _STATE_KEYWORDS[name])


def per_replica_states(original: Callable, positions: tuple, keywords: tuple) -> Callable:
    def call(*args: Any, **kwargs: Any) -> Any:
        context = _context.current_replica_context()
        if context is None:
            return original(*args, **kwargs)

        def per_replica(states: Any) -> Any:
            # the replica context's own marking (the SPMD program's pcast; the uneven step's
            # per-replica programs need none)
            leaves, treedef = jax.tree_util.tree_flatten(states)
            return jax.tree_util.tree_unflatten(treedef, context._prepare_for_gradients(leaves))

        args = list(args)
        for i in positions:
            if i < len(args) and args[i] is not None:
                args[i] = per_replica(args[i])
        for key in keywords:
            if kwargs.get(key) is not None:
                kwargs[key] = per_replica(kwargs[key])
        return original(*args, **kwargs)

    return call
