"""PS per-worker input reference values (TF 2.21 in-process cluster, 2 workers, 1 ps); prints JSON.

Run: /work/tfvenv/bin/python tests/parity/record_tf_ps_input.py (needs portpicker; about 20 s).
Measured 2026-12-01 (asserted in tests/test_port_ps_tf_tests.py, "measured on TF 2.21"):
{"input_context_inside_per_worker_dataset_fn": [[1, 0, 1]],
 "packed_partial_sums": [[6, 22], [6, 22], [17, 6], [17, 6], [22, 17], [22, 17]],
 "element_spec_batch4": "TensorSpec(shape=(None,), dtype=tf.int64, name=None)",
 "build_next_iter": [1, 1, 1, 1],
 "retrace_dtype": [["int32", [1, 3, 4]], ["float32", [0.0, 2.0, 3.0]], ["int32", [1, 3, 4]]], "retrace_dtype_traces": 2,
 "retrace_structure": [[1.0, 2.0], [10.0, 20.0]], "retrace_structure_traces": 2}
(the retrace_* cases are asserted in tests/test_parameter_server.py)
"""
import json, os
os.environ["TF_CPP_MIN_LOG_LEVEL"] = "3"
import portpicker, tensorflow as tf
def cluster(nw, nps):
    w = [portpicker.pick_unused_port() for _ in range(nw)]; p = [portpicker.pick_unused_port() for _ in range(nps)]
    spec = {"worker": ["localhost:%s" % x for x in w], "ps": ["localhost:%s" % x for x in p]}
    cs = tf.train.ClusterSpec(spec)
    for i in range(nw): tf.distribute.Server(cs, job_name="worker", task_index=i, protocol="grpc", start=True)
    for i in range(nps): tf.distribute.Server(cs, job_name="ps", task_index=i, protocol="grpc", start=True)
    return tf.distribute.cluster_resolver.SimpleClusterResolver(cs, rpc_layer="grpc")
strategy = tf.distribute.experimental.ParameterServerStrategy(cluster(2, 1))
coord = tf.distribute.coordinator.ClusterCoordinator(strategy)
out = {}
# input context seen by a per_worker_dataset_fn calling distribute_datasets_from_function
def dataset_fn(ctx):
    return tf.data.Dataset.from_tensors([ctx.num_input_pipelines, ctx.input_pipeline_id, ctx.num_replicas_in_sync]).repeat()
def per_worker_dataset_fn():
    return strategy.distribute_datasets_from_function(dataset_fn)
it = iter(coord.create_per_worker_dataset(per_worker_dataset_fn))
@tf.function
def first(it):
    return next(it)
rs = [coord.schedule(first, args=(it,)) for _ in range(6)]; coord.join()
out["input_context_inside_per_worker_dataset_fn"] = sorted({tuple(int(v) for v in r.fetch()) for r in rs})
# partial batches, packed: two next() per call over range(10).batch(4).repeat()
it = iter(coord.create_per_worker_dataset(lambda: tf.data.Dataset.range(10).batch(4).repeat()))
@tf.function
def two(it):
    return tf.reduce_sum(next(it)), tf.reduce_sum(next(it))
rs = [coord.schedule(two, args=(it,)) for _ in range(6)]; coord.join()
out["packed_partial_sums"] = sorted([[int(x) for x in r.fetch()] for r in rs])
# element_spec of a per-worker dataset with a partial batch
pw = coord.create_per_worker_dataset(lambda: tf.data.Dataset.range(10).batch(4))
out["element_spec_batch4"] = repr(pw.element_spec)
# build(): next(iter(dataset)) each call
pw = coord.create_per_worker_dataset(lambda: tf.data.Dataset.from_tensor_slices([1, 2]))
b = pw.build()
@tf.function
def f(ds):
    return next(iter(ds))
rs = [coord.schedule(f, args=(b,)) for _ in range(4)]; coord.join()
out["build_next_iter"] = [int(r.fetch()) for r in rs]
# a new element signature (dtype, structure) retraces the scheduled tf.function; a new iterator of a known one does not
@tf.function
def scaled(it):
    return next(it) * 3 // 2
ints = lambda: tf.data.Dataset.from_tensors(tf.constant([1, 2, 3], tf.int32)).repeat()
floats = lambda: tf.data.Dataset.from_tensors(tf.constant([0.5, 1.5, 2.5], tf.float32)).repeat()
rs = [coord.schedule(scaled, args=(iter(coord.create_per_worker_dataset(fn)),)) for fn in (ints, floats, ints)]
coord.join()
out["retrace_dtype"] = [[str(r.fetch().dtype), r.fetch().tolist()] for r in rs]
out["retrace_dtype_traces"] = scaled.experimental_get_tracing_count()
weights = {"a": 1.0, "b": 10.0}
@tf.function
def weighted(it):
    return sum(value * weights[key] for key, value in next(it).items())
dicts = [lambda k=k: tf.data.Dataset.from_tensors({k: tf.constant([1.0, 2.0])}).repeat() for k in "ab"]
rs = [coord.schedule(weighted, args=(iter(coord.create_per_worker_dataset(fn)),)) for fn in dicts]
coord.join()
out["retrace_structure"] = [r.fetch().tolist() for r in rs]
out["retrace_structure_traces"] = weighted.experimental_get_tracing_count()
print(json.dumps(out))
