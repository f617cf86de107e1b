"""TF 2.21 reference values for section "values" of tf_2_21.json (imported by record_tf.py).

SyncOnRead variables, regrouped Python results, static run arguments, gathers of
mismatched shapes, reduce_to / batch_reduce_to, scope nesting, InputContext's
text and the cross_device_ops classes.  Re-record with:

    /work/tfvenv/bin/python tests/parity/record_tf.py --only values
"""

import keras
import numpy as np
import tensorflow as tf

SECTION = "values"


def register(add_task, py, local, mirrored, guarded):
    S, M = tf.distribute.ReduceOp.SUM, tf.distribute.ReduceOp.MEAN

    def per_replica(s, make):
        return s.experimental_distribute_values_from_function(lambda c: make(c.replica_id_in_sync_group))

    # -- SyncOnRead variables (Keras 3 variables on the TF backend) ----------------------------
    def sync_on_read(aggregation):
        s = mirrored(2)
        with s.scope():
            v = keras.Variable(1.0, synchronization="on_read", aggregation=aggregation)
        out = {"created": {}}
        out["created"]["numpy"] = guarded(lambda: py(v.numpy()))
        with s.scope():
            out["created"]["numpy_in_scope"] = guarded(lambda: py(v.numpy()))
        # v.value is TF's SyncOnReadVariable: a DistributedValues.
        out["created"]["local_results"] = guarded(lambda: local(s, v.value))
        out["created"]["reduce_sum"] = guarded(lambda: py(s.reduce(S, v.value, axis=None)))
        out["created"]["reduce_mean"] = guarded(lambda: py(s.reduce(M, v.value, axis=None)))

        def step():
            ctx = tf.distribute.get_replica_context()
            read = v.value + 0.0
            v.assign_add(tf.cast(ctx.replica_id_in_sync_group, tf.float32) + 1.0)
            return read, v.value + 0.0

        def after_step():
            read, after = s.run(step)
            return {"read_in_run": local(s, read), "after_assign_add_in_run": local(s, after),
                    "numpy": py(v.numpy()), "local_results": local(s, v.value)}

        out["run_assign_add_replica_id_plus_1"] = guarded(after_step)

        def assign_cross_replica():
            with s.scope():
                v.assign(6.0)
                first = {"numpy": py(v.numpy()), "local_results": local(s, v.value)}
                v.assign_add(1.0)
                second = {"numpy": py(v.numpy()), "local_results": local(s, v.value)}
            return {"assign_6": first, "then_assign_add_1": second}

        out["cross_replica"] = guarded(assign_cross_replica)
        return out

    for aggregation in ("sum", "mean", "only_first_replica"):
        add_task((SECTION, f"sync_on_read_{aggregation}"), lambda a=aggregation: sync_on_read(a))

    def sync_on_read_none():
        s = mirrored(2)
        with s.scope():
            v = keras.Variable(1.0, synchronization="on_read", aggregation="none")
        return {"numpy": guarded(lambda: py(v.numpy()))}

    add_task((SECTION, "sync_on_read_none"), sync_on_read_none)

    def metric_in_run():
        s = mirrored(2)
        with s.scope():
            total = keras.metrics.Sum()
        x = per_replica(s, lambda r: tf.cast(r, tf.float32) + 1.0)

        def step(value):
            total.update_state(value)
            return total.result()

        inside = local(s, s.run(step, args=(x,)))
        return {"result_in_run": inside, "result_after": py(total.result()),
                "variable_local_results": local(s, total.variables[0].value)}

    add_task((SECTION, "metric_sum_updated_in_run"), metric_in_run)

    # -- Python results of run are regrouped as they are ----------------------------------
    def python_constant():
        s = mirrored(2)
        out = s.run(lambda: 8)
        return {"run_result": py(out), "run_result_type": type(out).__name__,
                "reduce_sum": guarded(lambda: py(s.reduce(S, out, axis=None))),
                "reduce_mean": guarded(lambda: py(s.reduce(M, out, axis=None)))}

    add_task((SECTION, "run_returns_python_8"), python_constant)

    # -- static (non-array) arguments of run ------------------------------------------------
    def static_args():
        s = mirrored(2)
        x = per_replica(s, lambda r: tf.constant([1.0, 2.0]) + 10.0 * tf.cast(r, tf.float32))
        with s.scope():
            model = keras.Sequential([keras.layers.Dense(1, kernel_initializer="ones", use_bias=False)])
            model.build((None, 2))
        return {
            "tag_and_value": local(s, s.run(lambda tag, v: v * 2.0 if tag == "tag" else v, args=("tag", x))),
            "returns_tag": py(s.run(lambda tag, v: tag, args=("tag", x))),
            "model_in_args": local(s, s.run(lambda m, v: m(v[None]), args=(model, x))),
        }

    add_task((SECTION, "run_static_args"), static_args)

    # -- gathers of values whose non-gathered dims differ (each in its own process: an
    #    aborted TF collective poisons the next ones) -------------------------------------
    def uneven_batch(s):
        ds = tf.data.Dataset.from_tensor_slices(np.arange(6, dtype=np.float32).reshape(3, 2)).batch(4)
        return next(iter(s.experimental_distribute_dataset(ds)))

    def gather_uneven(axis):
        s = mirrored(2)
        return guarded(lambda: py(s.gather(uneven_batch(s), axis=axis)))

    def all_gather_uneven(axis):
        s = mirrored(2)
        fn = lambda v: tf.distribute.get_replica_context().all_gather(v, axis=axis)
        return guarded(lambda: local(s, s.run(fn, args=(uneven_batch(s),))))

    for axis in (0, 1):
        add_task((SECTION, f"gather_uneven_batch_axis_{axis}"), lambda a=axis: gather_uneven(a))
        add_task((SECTION, f"all_gather_uneven_batch_axis_{axis}"), lambda a=axis: all_gather_uneven(a))

    # -- reduce_to / batch_reduce_to ----------------------------------------------------
    def kind_and_value(s, r):
        if isinstance(r, tf.distribute.DistributedValues):
            return {"type": type(r).__name__, "local_results": local(s, r)}
        return {"type": type(r).__name__, "value": py(r)}

    def default_reduce_to():
        d = tf.distribute.get_strategy()
        return {
            "reduce_to_sum": kind_and_value(d, d.extended.reduce_to(S, tf.constant(3.0), destinations="/cpu:0")),
            "reduce_to_mean": kind_and_value(d, d.extended.reduce_to(M, tf.constant(3.0), destinations="/cpu:0")),
            "batch_reduce_to_sum": [kind_and_value(d, r) for r in d.extended.batch_reduce_to(
                S, [(tf.constant(3.0), "/cpu:0"), (tf.constant(4.0), "/cpu:0")])],
        }

    add_task((SECTION, "default_strategy_reduce_to"), default_reduce_to)

    def mirrored_reduce_to():
        s = mirrored(2)
        x = per_replica(s, lambda r: tf.constant([1.0, 2.0]) + 10.0 * tf.cast(r, tf.float32))
        return {
            "per_replica_to_per_replica": kind_and_value(s, s.extended.reduce_to(S, x, destinations=x)),
            "per_replica_to_device_name": kind_and_value(s, s.extended.reduce_to(S, x, destinations="/cpu:1")),
            "plain_mean": kind_and_value(s, s.extended.reduce_to(M, tf.constant(3.0), destinations=x)),
            "plain_sum": guarded(lambda: kind_and_value(s, s.extended.reduce_to(S, tf.constant(3.0), destinations=x))),
            "batch_mean_to_replicas_and_device": [kind_and_value(s, r) for r in s.extended.batch_reduce_to(M, [(x, x), (x, "/cpu:0")])],
            "batch_mean_to_device_only": [kind_and_value(s, r) for r in s.extended.batch_reduce_to(M, [(x, "/cpu:0")])],
        }

    add_task((SECTION, "mirrored_reduce_to"), mirrored_reduce_to)

    # -- scopes, aliases, InputContext ----------------------------------------------------
    def same_scope_nesting():
        s = mirrored(2)
        a = s.scope()
        with a:
            b = s.scope()
            with b:
                with a:
                    inner = tf.distribute.get_strategy() is s
                middle = tf.distribute.get_strategy() is s
            outer = tf.distribute.get_strategy() is s
        return {"inner": inner, "middle": middle, "outer": outer, "has_strategy_after": tf.distribute.has_strategy(),
                "has_alias": hasattr(s, "experimental_distribute_datasets_from_function")}

    add_task((SECTION, "same_scope_nesting"), same_scope_nesting)
    add_task((SECTION, "input_context_str"), lambda: {
        "pipelines_2_id_1_replicas_4": str(tf.distribute.InputContext(num_input_pipelines=2, input_pipeline_id=1, num_replicas_in_sync=4)),
        "default": str(tf.distribute.InputContext()),
    })

    # -- cross_device_ops --------------------------------------------------------------------
    def cross_device_ops(name):
        s = mirrored(2)
        x = per_replica(s, lambda r: tf.constant([1.0, 2.0]) + 10.0 * tf.cast(r, tf.float32))
        ops = getattr(tf.distribute, name)()
        out = {
            "reduce_sum_to_replicas": guarded(lambda: kind_and_value(s, ops.reduce(S, x, destinations=x))),
            "reduce_mean_to_device_name": guarded(lambda: kind_and_value(s, ops.reduce(M, x, destinations="/cpu:0"))),
            "reduce_sum_of_plain_value": guarded(lambda: kind_and_value(s, ops.reduce(S, tf.constant(3.0), destinations=x))),
            "batch_reduce_mean": guarded(lambda: [kind_and_value(s, r) for r in ops.batch_reduce(M, [(x, x), (x, "/cpu:1")])]),
            "broadcast": guarded(lambda: kind_and_value(s, ops.broadcast(tf.constant(2.0), x))),
        }
        if name in ("NcclAllReduce", "HierarchicalCopyAllReduce"):
            out["num_packs_minus_1"] = guarded(lambda: getattr(tf.distribute, name)(num_packs=-1) and None)
        strategy = tf.distribute.MirroredStrategy(s.extended.worker_devices, cross_device_ops=ops)
        out["strategy_with_it_reduce_sum_replica_id"] = py(strategy.reduce(
            S, strategy.run(lambda: tf.distribute.get_replica_context().replica_id_in_sync_group), axis=None))
        return out

    for name in ("NcclAllReduce", "HierarchicalCopyAllReduce", "ReductionToOneDevice", "CrossDeviceOps"):
        add_task((SECTION, f"cross_device_ops_{name}"), lambda n=name: cross_device_ops(n))

    # -- cross-replica reads of a MirroredVariable / SyncOnRead variable beside reduce's result ---
    def cross_replica_reads(shape):
        """``v = keras.Variable(ones(shape))`` in scope, ``loss = reduce(SUM, run(lambda: 2.0))`` = 4.0, then arithmetic."""
        s = mirrored(2)
        init = np.ones(shape, np.float32) if shape else 1.0
        with s.scope():
            v = keras.Variable(init)
            w = keras.Variable(init, synchronization="on_read", aggregation="sum")
            metric = keras.metrics.Mean()
        loss = s.reduce(S, s.run(lambda: tf.constant(2.0)), axis=None)
        s.run(lambda: metric.update_state(tf.cast(tf.distribute.get_replica_context().replica_id_in_sync_group, tf.float32) + 1.0))
        out = {
            "loss": py(loss),
            "loss_device": loss.device,
            "value_device": guarded(lambda: v.value.device),
            "v_plus_loss": guarded(lambda: py(v + loss)),
            "v_plus_loss_device": guarded(lambda: (v + loss).device),
            "loss_plus_v": guarded(lambda: py(loss + v)),
            "v_times_loss": guarded(lambda: py(v * loss)),
            "ops_add": guarded(lambda: py(keras.ops.add(v, loss))),
            "maximum": guarded(lambda: py(tf.maximum(v, loss))),
            "ops_maximum": guarded(lambda: py(keras.ops.maximum(v, loss))),
            "numpy": guarded(lambda: py(v.numpy())),
            "convert_to_tensor_plus_loss": guarded(lambda: py(keras.ops.convert_to_tensor(v) + loss)),
            "sync_on_read_plus_loss": guarded(lambda: py(w + loss)),
            "metric_result_plus_loss": guarded(lambda: py(metric.result() + loss)),
            "run_v_plus_loss": guarded(lambda: local(s, s.run(lambda: v + loss))),
            "run_v_plus_loss_arg": guarded(lambda: local(s, s.run(lambda x: v + x, args=(loss,)))),
        }

        def assign():
            v.assign(v + loss)
            first = py(v.numpy())
            with s.scope():
                v.assign_add(loss)
            return {"assign_v_plus_loss": first, "then_assign_add_loss_in_scope": py(v.numpy()),
                    "local_results": local(s, v)}

        out["assign"] = guarded(assign)
        return out

    for name, shape in (("scalar", ()), ("shape_3", (3,)), ("shape_2x2", (2, 2))):
        add_task((SECTION, f"cross_replica_read_{name}"), lambda sh=shape: cross_replica_reads(sh))
