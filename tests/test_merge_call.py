"""ReplicaContext.merge_call: TF 2.21's answers (tests/parity/tf_2_21_tape.json, "merge_call"), in the
compiled step, under distribute.function, in an uneven (eager) step and under the default strategy.

Where TF's run returns one value for results that are the same on every replica (TF's regroup of one
tensor object), run returns a PerReplica of that value on each replica here."""

from __future__ import annotations

import json
import pathlib

import keras
import numpy as np
import pytest
from helpers import mirrored

import distribute

TF = json.loads((pathlib.Path(__file__).parent / "parity" / "tf_2_21_tape.json").read_text())["merge_call"]


def _replica_value():
    ctx = distribute.get_replica_context()
    return ctx, keras.ops.cast(ctx.replica_id_in_sync_group + 1, "float32")


def reduce_sum():
    ctx, v = _replica_value()
    return ctx.merge_call(lambda s, value: s.reduce("SUM", value, axis=None), args=(v,))


def local_results():
    ctx, v = _replica_value()
    out = ctx.merge_call(lambda s, value: s.experimental_local_results(value), args=(v,))
    return out[0] * 10 + out[1], len(out)


def identity():
    ctx, v = _replica_value()
    return ctx.merge_call(lambda s, value: value, args=(v,))


def keyword():
    ctx, v = _replica_value()
    return ctx.merge_call(lambda s, a, b=None: s.reduce("MEAN", a, axis=None) + b, args=(v,), kwargs={"b": 10.0})


def pair():
    ctx, v = _replica_value()
    return ctx.merge_call(lambda s, value: (s.reduce("SUM", value, axis=None), value), args=(v,))


def _per_replica(strategy, value):
    return [float(v) for v in strategy.experimental_local_results(value)]


def _matches(strategy, result, expected) -> bool:
    """Our result against TF's recorded one; TF's single value for one tensor on every replica is that
    value on each replica here."""
    if isinstance(result, tuple):
        return len(result) == len(expected) and all(_matches(strategy, r, e) for r, e in zip(result, expected))
    if isinstance(result, int):
        return result == expected
    values = _per_replica(strategy, result)
    return values == expected or (not isinstance(expected, list) and values == [expected] * len(values))


@pytest.mark.parametrize("compiled_outer", [False, True])
@pytest.mark.parametrize("fn", [reduce_sum, local_results, identity, keyword, pair], ids=lambda f: f.__name__)
def test_merge_call_gives_tf_values(fn, compiled_outer):
    strategy = mirrored(2)
    run = distribute.function(lambda: strategy.run(fn)) if compiled_outer else (lambda: strategy.run(fn))
    expected = TF[fn.__name__ + ("_tf_function" if compiled_outer else "")]
    result = run()
    assert _matches(strategy, result, expected), (result, expected)


def test_merge_fn_runs_in_cross_replica_context_with_the_strategy():
    strategy = mirrored(2)
    seen = []

    def fn():
        ctx = distribute.get_replica_context()
        ctx.merge_call(lambda s: seen.append((distribute.in_cross_replica_context(),
                                              distribute.get_replica_context() is None, s is strategy)))
        return ctx.replica_id_in_sync_group

    strategy.run(fn)
    assert seen and all(list(entry) == TF["context"] for entry in seen)


def test_merge_call_under_the_default_strategy():
    import jax.numpy as jnp

    ctx = distribute.get_replica_context()
    assert float(ctx.merge_call(lambda s, x: s.reduce("SUM", x, axis=None) * 2, args=(jnp.asarray(3.0),))) == TF["default_strategy"]


def test_merge_call_in_an_uneven_step():
    """Rows [1, 2] | [3]: merge_fn reduces axis 0 over every replica's real rows (TF: 6.0)."""
    strategy = mirrored(2)
    ds = distribute.data.Dataset.from_tensor_slices(np.array([1.0, 2.0, 3.0], np.float32)).batch(3)

    def fn(x):
        ctx = distribute.get_replica_context()
        return ctx.merge_call(lambda s, value: s.reduce("SUM", value, axis=0), args=(x,))

    got = [strategy.run(fn, args=(x,)) for x in strategy.experimental_distribute_dataset(ds)]
    assert len(got) == len(TF["uneven_reduce_axis0"])
    assert all(_matches(strategy, g, e) for g, e in zip(got, TF["uneven_reduce_axis0"]))


def test_merge_call_with_a_non_callable_is_a_type_error():
    strategy = mirrored(2)
    with pytest.raises(TypeError, match="callable"):
        strategy.run(lambda: distribute.get_replica_context().merge_call(3))
