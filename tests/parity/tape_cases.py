"""GradientTape programs written once for TensorFlow and for distribute (no framework imported here).

Each case takes a namespace ``ns`` (``ns.GT`` the tape class, ``ns.var`` a
variable, ``ns.const`` a float32 array, ``ns.to_int``, ``ns.stop_gradient``,
``ns.square``) and returns a function without arguments: the step, which
``record_tf_tape.py`` runs eagerly under TF 2.21 and ``tests/test_gradient_tape.py``
runs as a ``distribute.function``.  Variables are made before the step, as a
``tf.function`` requires.
"""

from __future__ import annotations

CASES: dict = {}


def case(fn):
    CASES[fn.__name__] = fn
    return fn


@case
def second_call_non_persistent(ns):
    x = ns.const(3.0)

    def step():
        with ns.GT() as t:
            t.watch(x)
            y = x * x
        g = t.gradient(y, x)
        return g, t.gradient(y, x)
    return step


@case
def unwatched_tensor(ns):
    x = ns.const(3.0)

    def step():
        with ns.GT() as t:
            y = x * x
        return t.gradient(y, x)
    return step


@case
def integer_target(ns):
    x = ns.const(3.0)

    def step():
        with ns.GT() as t:
            t.watch(x)
            y = ns.to_int(x) * 2
        return t.gradient(y, x)
    return step


@case
def stop_gradient(ns):
    x = ns.const(3.0)

    def step():
        with ns.GT() as t:
            t.watch(x)
            y = ns.stop_gradient(x) * 2
        return t.gradient(y, x)
    return step


@case
def intermediate_source(ns):
    v = ns.var(2.0)

    def step():
        with ns.GT() as t:
            h = v * 3
            y = h * h
        return t.gradient(y, h), len(t.watched_variables())
    return step


@case
def stop_recording(ns):
    v = ns.var(2.0)

    def step():
        with ns.GT() as t:
            y = v * 3
            with t.stop_recording():
                z = y * 5
            w = z + y
        return t.gradient(w, v)
    return step


@case
def reset(ns):
    v = ns.var(2.0)

    def step():
        with ns.GT() as t:
            y = v * 3
            t.reset()
            z = v * 5
            w = y + z
        return t.gradient(w, v)
    return step


@case
def reset_drops_watched_tensors(ns):
    v = ns.var(2.0)
    x = ns.const(1.0)

    def step():
        with ns.GT() as t:
            t.watch(x)
            y = v * 3 * x
            t.reset()
            w = y + x * v
        return t.gradient(w, [v, x])
    return step


@case
def unconnected_zero(ns):
    v, u = ns.var(2.0), ns.var(1.0)

    def step():
        with ns.GT() as t:
            y = v * 3
        return t.gradient(y, [v, u], unconnected_gradients="zero")
    return step


@case
def unconnected_none(ns):
    v, u = ns.var(2.0), ns.var(1.0)

    def step():
        with ns.GT() as t:
            y = v * 3
        return t.gradient(y, [v, u])
    return step


@case
def gradient_inside_block_then_again(ns):
    v = ns.var(2.0)

    def step():
        with ns.GT() as t:
            y = v * 3
            g = t.gradient(y, v)
            z = v * v
        return g, t.gradient(z, v)
    return step


@case
def output_gradients(ns):
    v = ns.var([1.0, 2.0])

    def step():
        with ns.GT() as t:
            y = v * v
        return t.gradient(y, v, output_gradients=ns.const([10.0, 100.0]))
    return step


@case
def assign_in_block(ns):
    v = ns.var(2.0)

    def step():
        with ns.GT() as t:
            v.assign(v * 3)
            y = v * v
        return t.gradient(y, v)
    return step


@case
def no_watch_accessed_variables(ns):
    v = ns.var(2.0)

    def step():
        with ns.GT(watch_accessed_variables=False) as t:
            y = v * v
        return t.gradient(y, v), len(t.watched_variables())
    return step


@case
def watch_variable_explicitly(ns):
    v, u = ns.var(2.0), ns.var(5.0)

    def step():
        with ns.GT(watch_accessed_variables=False) as t:
            t.watch(v)
            y = v * v * u
        return t.gradient(y, [v, u]), len(t.watched_variables())
    return step


@case
def nested_second_order(ns):
    x = ns.const(2.0)

    def step():
        with ns.GT() as t1:
            t1.watch(x)
            with ns.GT() as t2:
                t2.watch(x)
                y = x * x * x
            dy = t2.gradient(y, x)
        return dy, t1.gradient(dy, x)
    return step


@case
def nested_second_order_variables(ns):
    v = ns.var([1.0, 2.0])

    def step():
        with ns.GT() as outer:
            with ns.GT() as inner:
                y = ns.square(v) * v
            g = inner.gradient(y, v)
            z = g * g
        return g, outer.gradient(z, v)
    return step


@case
def persistent(ns):
    x = ns.const(2.0)

    def step():
        with ns.GT(persistent=True) as t:
            t.watch(x)
            y = x * x
            z = y * y
        return t.gradient(z, x), t.gradient(y, x)
    return step


@case
def persistent_gradient_inside_block(ns):
    v = ns.var(2.0)

    def step():
        with ns.GT(persistent=True) as t:
            y = v * v
            g = t.gradient(y, v)
            z = g * v
        return g, t.gradient(z, v)
    return step


@case
def nested_structures(ns):
    x = ns.const([2.0, 3.0])

    def step():
        with ns.GT() as t:
            t.watch(x)
            y = x * x
        return t.gradient({"a": y}, {"b": x, "c": [x]})
    return step


@case
def list_target(ns):
    v = ns.var(2.0)

    def step():
        with ns.GT() as t:
            y = [v * 2, v * 3]
        return t.gradient(y, v)
    return step


@case
def variable_and_tensor_sources(ns):
    v = ns.var(2.0)
    x = ns.const(5.0)

    def step():
        with ns.GT() as t:
            t.watch(x)
            y = v * x
        return t.gradient(y, [v, x]), len(t.watched_variables())
    return step


@case
def jacobians(ns):
    x = ns.const([[1.0, 2.0], [3.0, 4.0]])

    def step():
        with ns.GT(persistent=True) as t:
            t.watch(x)
            y = x * x
        return t.jacobian(y, x), t.batch_jacobian(y, x)
    return step


@case
def watch_intermediate_computed_before(ns):
    v = ns.var(2.0)

    def step():
        h = v * 3.0
        with ns.GT() as t:
            t.watch(h)
            y = h * h
        return t.gradient(y, [h, v])
    return step


@case
def watched_tensor_used_before_the_watch(ns):
    x = ns.const(2.0)

    def step():
        with ns.GT() as t:
            before = x * 10.0
            t.watch(x)
            y = before * x
        return t.gradient(y, x)
    return step


@case
def reenter_after_exit(ns):
    v = ns.var(2.0)

    def step():
        with ns.GT() as t:
            y = v * 3
        with t:
            z = v * 5 + y
        return t.gradient(z, v)
    return step


@case
def two_tapes_one_block(ns):
    v, u = ns.var(2.0), ns.var(1.0)

    def step():
        with ns.GT() as gen_tape, ns.GT() as disc_tape:
            a = v * v
            b = u * a
        return gen_tape.gradient(a, v), disc_tape.gradient(b, [u, v])
    return step


@case
def gradient_penalty(ns):
    """The WGAN-GP pattern: the norm of an inner gradient in the outer loss."""
    w = ns.var([0.5, -1.0])
    real, fake = ns.const([[1.0, 2.0]]), ns.const([[3.0, 1.0]])

    def step():
        with ns.GT() as outer:
            interpolated = 0.25 * real + 0.75 * fake
            with ns.GT() as gp_tape:
                gp_tape.watch(interpolated)
                pred = ns.square(interpolated * w) * w
            grads = gp_tape.gradient(pred, [interpolated])[0]
            penalty = ns.square(ns.square(grads) - 1.0)
        return grads, outer.gradient(penalty, w)
    return step
