"""Cluster resolution: ClusterSpec, TF_CONFIG, Simple and Slurm resolvers, chief and worker numbering.

Expected values follow TensorFlow's own tests (server_lib, tfconfig_cluster_resolver_test,
slurm_cluster_resolver_test, multi_worker_util) where TF defines the behaviour.
"""

import dataclasses
import json
import os

import pytest
from hypothesis import given
from hypothesis import strategies as st

from distribute.cluster import (
    ClusterSpec,
    SimpleClusterResolver,
    SlurmClusterResolver,
    TFConfig,
    TFConfigClusterResolver,
    coordinator_address,
    expand_hostlist,
    expand_tasks_per_node,
    is_chief,
    num_workers,
    parse_tf_config,
    validate_task,
    worker_index,
)

PS_WORKER = {"ps": ["ps0:2222", "ps1:2222"], "worker": ["worker0:2222", "worker1:2222", "worker2:2222"]}


def tf_config(cluster=PS_WORKER, task=("ps", 0), **extra):
    config = {"cluster": cluster, **extra}
    if task is not None:
        config["task"] = {"type": task[0], "index": task[1]}
    return json.dumps(config)


# ----------------------------------------------------------------------------- ClusterSpec


def test_cluster_spec_dense_jobs():
    spec = ClusterSpec(PS_WORKER)
    assert spec.jobs == ["ps", "worker"]
    assert spec.num_tasks("worker") == 3
    assert spec.task_indices("worker") == [0, 1, 2]
    assert spec.task_address("worker", 2) == "worker2:2222"
    assert spec.job_tasks("ps") == ["ps0:2222", "ps1:2222"]
    assert spec.as_dict() == PS_WORKER
    assert bool(spec) and not ClusterSpec({})


def test_cluster_spec_sparse_job_as_tf():
    spec = ClusterSpec({"worker": {1: "w1:2222", "3": "w3:2222"}, "ps": ["ps0:2222"]})
    assert spec.num_tasks("worker") == 2
    assert spec.task_indices("worker") == [1, 3]
    assert spec.job_tasks("worker") == [None, "w1:2222", None, "w3:2222"]
    assert spec.as_dict() == {"worker": {1: "w1:2222", 3: "w3:2222"}, "ps": ["ps0:2222"]}


def test_cluster_spec_equality_copy_and_repr():
    spec = ClusterSpec(PS_WORKER)
    assert spec == ClusterSpec(PS_WORKER) == ClusterSpec(spec)
    assert spec == PS_WORKER  # as_dict form
    assert spec == {"ps": {0: "ps0:2222", 1: "ps1:2222"},
                    "worker": {0: "worker0:2222", 1: "worker1:2222", 2: "worker2:2222"}}  # TF's form
    assert spec != ClusterSpec({"worker": ["worker0:2222"]})
    assert hash(spec) == hash(ClusterSpec(PS_WORKER))
    assert repr(ClusterSpec({"worker": ["a:1"], "chief": ["c:1"]})) == (
        "ClusterSpec({'chief': ['c:1'], 'worker': ['a:1']})")


def test_cluster_spec_is_immutable_through_as_dict():
    spec = ClusterSpec(PS_WORKER)
    spec.as_dict()["worker"].append("x:1")
    assert spec.num_tasks("worker") == 3


def test_cluster_spec_errors():
    spec = ClusterSpec(PS_WORKER)
    with pytest.raises(ValueError, match="No such job in cluster: 'chief'"):
        spec.num_tasks("chief")
    with pytest.raises(ValueError, match="No task with index 7 in job 'worker'"):
        spec.task_address("worker", 7)
    with pytest.raises(TypeError, match="must be a list or a dictionary"):
        ClusterSpec({"worker": "w0:2222"})
    with pytest.raises(TypeError, match="must be a dictionary mapping"):
        ClusterSpec(["w0:2222"])
    with pytest.raises(TypeError, match="must be a string"):
        ClusterSpec({"worker": [2222]})


# ----------------------------------------------------------------------------- TF_CONFIG parsing


def test_parse_tf_config_full():
    config = parse_tf_config(tf_config(rpc_layer="grpc", session_master="m:1", environment="cloud"))
    assert config.cluster == ClusterSpec(PS_WORKER)
    assert (config.task.type, config.task.index) == ("ps", 0)
    assert (config.rpc_layer, config.session_master, config.environment) == ("grpc", "m:1", "cloud")
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.task = None
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.task.index = 1


@pytest.mark.parametrize("text", [None, "", "  ", "{}", '{"cluster": {}}'])
def test_parse_tf_config_unset_means_local(text):
    config = parse_tf_config(text)
    assert config == TFConfig() and not config.cluster and config.task is None


def test_parse_tf_config_sparse_job_and_ipv6():
    config = parse_tf_config(json.dumps({"cluster": {"worker": {"0": "[::1]:2222", "1": "h-1.x:2223"}},
                                         "task": {"type": "worker", "index": 1}}))
    assert config.cluster.task_address("worker", 0) == "[::1]:2222"


def test_index_string_accepted_as_tf():
    assert parse_tf_config(tf_config(task=("ps", "1"))).task.index == 1
    assert parse_tf_config(tf_config(task=("ps", 1.0))).task.index == 1


BAD_CONFIGS = {
    "not_json": ("{cluster: [}", r"TF_CONFIG is not valid JSON.*set it to a JSON object"),
    "not_object": ("[1, 2]", r"not a JSON object"),
    "cluster_missing": ('{"task": {"type": "worker", "index": 0}}', r"'task' but no 'cluster'.*add the cluster"),
    "cluster_not_mapping": ('{"cluster": ["a:1", "b:2"]}', r"TF_CONFIG\['cluster'\].*not a mapping"),
    "job_not_list": (tf_config({"worker": "a:1"}, ("worker", 0)),
                     r"TF_CONFIG\['cluster'\]\['worker'\] is 'a:1'; a job must be a non-empty list"),
    "job_empty": (tf_config({"worker": [], "ps": ["p:1"]}, ("ps", 0)), r"\['worker'\] is an empty list"),
    "address_not_string": (tf_config({"worker": [2222]}, ("worker", 0)),
                           r"\['worker'\]\[0\] is 2222, which is not a 'host:port'"),
    "address_no_port": (tf_config({"worker": ["a:1", "localhost"]}, ("worker", 0)),
                        r"\['worker'\]\[1\] is 'localhost'.*e.g. 'localhost:2222'"),
    "address_bad_port": (tf_config({"worker": ["a:99999"]}, ("worker", 0)), r"port in 1..65535"),
    "address_text_port": (tf_config({"worker": ["a:b"]}, ("worker", 0)), r"not a 'host:port'"),
    "address_space": (tf_config({"worker": ["a b:1"]}, ("worker", 0)), r"not a 'host:port'"),
    "two_chiefs": (tf_config({"chief": ["c:1", "c:2"], "worker": ["w:1"]}, ("worker", 0)),
                   r"\['chief'\] has 2 tasks; there must be at most one 'chief'. Make the others 'worker'"),
    "two_evaluators": (tf_config({"evaluator": ["e:1", "e:2"]}, ("evaluator", 0)), r"at most one 'evaluator'"),
    "task_missing": (tf_config(task=None), r"TF_CONFIG has no 'task'.*cluster has 5 tasks.*\"task\""),
    "task_not_mapping": (json.dumps({"cluster": PS_WORKER, "task": "worker"}), r"\['task'\].*not a mapping"),
    "task_type_missing": (json.dumps({"cluster": PS_WORKER, "task": {"index": 0}}), r"no 'type' key"),
    "task_index_missing": (json.dumps({"cluster": PS_WORKER, "task": {"type": "ps"}}), r"no 'index' key"),
    "index_out_of_range": (tf_config(task=("worker", 3)),
                           r"\['index'\] is 3, but job 'worker' has 3 task\(s\) with indices \[0, 1, 2\]"),
    "index_negative": (tf_config(task=("worker", -1)), r"\['index'\] is -1, which is negative"),
    "index_negative_string": (tf_config(task=("worker", "-1")), r"negative"),
    "index_word": (tf_config(task=("worker", "one")), r"\['index'\] is 'one', which is not an integer"),
    "index_fraction": (tf_config(task=("worker", 1.5)), r"not an integer"),
    "index_bool": (tf_config(task=("worker", True)), r"not an integer"),
    "index_null": (tf_config(task=("worker", None)), r"not an integer"),
    "unknown_task_type": (tf_config(task=("master", 0)),
                          r"\['task'\]\['type'\] is 'master', which is not a task type; use one of"),
    "task_type_not_in_cluster": (tf_config(task=("chief", 0)), r"has no 'chief' job"),
    "unknown_job": (tf_config({"workers": ["a:1"]}, ("worker", 0)), r"job 'workers', which is not a task type"),
    "same_address_in_job": (tf_config({"worker": ["a:1", "a:1"]}, ("worker", 0)),
                            r"address 'a:1' to both worker 0 and worker 1; every task needs its own"),
    "same_address_across_jobs": (tf_config({"chief": ["h:5"], "worker": ["w:1"], "ps": ["h:5"]}, ("worker", 0)),
                                 r"address 'h:5' to both chief 0 and ps 0"),
    "rpc_layer_not_string": (tf_config(rpc_layer=7), r"\['rpc_layer'\] is 7, which is not a string"),
}


@pytest.mark.parametrize("text,message", BAD_CONFIGS.values(), ids=BAD_CONFIGS.keys())
def test_bad_tf_config_raises_value_error(text, message, monkeypatch):
    with pytest.raises(ValueError, match=message):
        parse_tf_config(text)
    monkeypatch.setenv("TF_CONFIG", text)
    with pytest.raises(ValueError, match=message):
        TFConfigClusterResolver()


# ----------------------------------------------------------------------------- TFConfigClusterResolver
# Cases from TF's tfconfig_cluster_resolver_test.py.


def test_tfconfig_resolver_reads_environment(monkeypatch):
    monkeypatch.setenv("TF_CONFIG", tf_config(rpc_layer="grpc"))
    resolver = TFConfigClusterResolver()
    assert resolver.cluster_spec() == ClusterSpec(PS_WORKER)
    assert (resolver.task_type, resolver.task_id, resolver.rpc_layer) == ("ps", 0, "grpc")
    assert resolver.master() == "grpc://ps0:2222"
    assert resolver.master("worker", 1) == "grpc://worker1:2222"
    assert resolver.master("worker", 1, rpc_layer="") == "worker1:2222"  # TF tests `is not None` here
    assert resolver.num_accelerators() == {}
    assert resolver.environment is None
    assert resolver.is_chief is False


def test_tfconfig_resolver_without_rpc_layer_and_session_master(monkeypatch):
    monkeypatch.setenv("TF_CONFIG", tf_config())
    assert TFConfigClusterResolver().master() == "ps0:2222"
    monkeypatch.setenv("TF_CONFIG", tf_config(session_master="sessionmaster:2222"))
    assert TFConfigClusterResolver().master() == "sessionmaster:2222"


def test_tfconfig_resolver_overrides_and_setters(monkeypatch):
    monkeypatch.setenv("TF_CONFIG", tf_config(task=("ps", 1), rpc_layer="grpc"))
    resolver = TFConfigClusterResolver(task_type="ps", task_id=0)
    assert resolver.master() == "grpc://ps0:2222"
    resolver.task_type, resolver.task_id, resolver.rpc_layer = "worker", 1, "test"
    assert resolver.master() == "test://worker1:2222"
    assert (resolver.task_type, resolver.task_id, resolver.rpc_layer) == ("worker", 1, "test")
    assert TFConfigClusterResolver(task_id="0").task_id == 0
    with pytest.raises(ValueError, match="task_type 'gpu' is not a task type"):
        resolver.task_type = "gpu"
    with pytest.raises(ValueError, match="task_id is 'x', which is not an integer"):
        resolver.task_id = "x"
    with pytest.raises(ValueError, match="task_id 5 is out of range for job 'ps'"):
        TFConfigClusterResolver(task_id=5)


def test_tfconfig_override_supplies_missing_task(monkeypatch):
    monkeypatch.setenv("TF_CONFIG", tf_config(task=None))
    resolver = TFConfigClusterResolver(task_type="worker", task_id=2)
    assert resolver.master() == "worker2:2222"
    with pytest.raises(ValueError, match="the task index is not set"):
        TFConfigClusterResolver(task_type="worker")


def test_tfconfig_resolver_reads_environment_once(monkeypatch):
    monkeypatch.setenv("TF_CONFIG", tf_config(task=("worker", 1)))
    resolver = TFConfigClusterResolver()
    monkeypatch.setenv("TF_CONFIG", "not json")
    assert (resolver.task_type, resolver.task_id) == ("worker", 1)
    assert resolver.tf_config.cluster == ClusterSpec(PS_WORKER)


@pytest.mark.parametrize("text", [None, "{}"])
def test_tfconfig_no_cluster_is_local(text, monkeypatch):
    if text is None:
        monkeypatch.delenv("TF_CONFIG", raising=False)
    else:
        monkeypatch.setenv("TF_CONFIG", text)
    resolver = TFConfigClusterResolver()
    assert resolver.cluster_spec() == ClusterSpec({}) and not resolver.cluster_spec()
    assert (resolver.task_type, resolver.task_id, resolver.rpc_layer) == (None, None, None)
    assert resolver.master() == "" and resolver.is_chief


def test_tfconfig_single_task_cluster_without_task_as_tf():
    resolver = TFConfigClusterResolver.from_tf_config('{"cluster": {"worker": ["worker0:2222"]}}')
    assert (resolver.task_type, resolver.task_id) == (None, None)
    assert resolver.master() == ""
    assert resolver.is_chief


def test_tfconfig_from_parsed_config():
    config = parse_tf_config(tf_config(task=("worker", 0)))
    resolver = TFConfigClusterResolver.from_tf_config(config, rpc_layer="grpc")
    assert resolver.tf_config is config
    assert resolver.master() == "grpc://worker0:2222"


@pytest.mark.parametrize("cluster,task,expected", [
    ({"chief": ["c:1"], "worker": ["w:1", "w:2"]}, ("chief", 0), True),
    ({"chief": ["c:1"], "worker": ["w:1", "w:2"]}, ("worker", 0), False),
    ({"worker": ["w:1", "w:2"]}, ("worker", 0), True),
    ({"worker": ["w:1", "w:2"]}, ("worker", 1), False),
    ({"worker": ["w:1"], "ps": ["p:1"], "evaluator": ["e:1"]}, ("evaluator", 0), True),
    ({"worker": ["w:1"], "ps": ["p:1"]}, ("ps", 0), False),
])
def test_is_chief_as_tf(cluster, task, expected):
    resolver = TFConfigClusterResolver.from_tf_config(tf_config(cluster, task))
    assert resolver.is_chief is expected
    assert is_chief(cluster, *task) is expected


def test_is_chief_needs_task_in_multi_task_cluster():
    resolver = SimpleClusterResolver(ClusterSpec({"worker": ["w:1", "w:2"]}))
    with pytest.raises(ValueError, match="cannot tell whether this task is the chief"):
        resolver.is_chief


# ----------------------------------------------------------------------------- roles


CHIEF_CLUSTER = {"chief": ["c:1"], "worker": ["w:1", "w:2"], "ps": ["p:1"], "evaluator": ["e:1"]}


def test_worker_index_numbers_chief_first():
    assert worker_index("chief", 0, CHIEF_CLUSTER) == 0
    assert worker_index("worker", 0, CHIEF_CLUSTER) == 1
    assert worker_index("worker", 1, CHIEF_CLUSTER) == 2
    assert worker_index("evaluator", 0, CHIEF_CLUSTER) == 0
    assert worker_index("worker", 1, {"worker": ["w:1", "w:2"]}) == 1
    with pytest.raises(ValueError, match="no worker index for task_type 'ps'"):
        worker_index("ps", 0, CHIEF_CLUSTER)
    with pytest.raises(ValueError, match="task_id 2 is out of range for job 'worker'"):
        worker_index("worker", 2, CHIEF_CLUSTER)


def test_num_workers_and_coordinator_address():
    assert num_workers(CHIEF_CLUSTER) == 3
    assert num_workers({"worker": ["w:1", "w:2"], "ps": ["p:1"]}) == 2
    assert num_workers({}) == 0
    assert coordinator_address(CHIEF_CLUSTER) == "c:1"
    assert coordinator_address(ClusterSpec({"worker": ["w:1", "w:2"]})) == "w:1"
    with pytest.raises(ValueError, match="no 'chief' task and no 'worker' task 0"):
        coordinator_address({"ps": ["p:1"]})


def test_validate_task_errors():
    with pytest.raises(ValueError, match="Unrecognized task_type 'boss'"):
        validate_task(CHIEF_CLUSTER, "boss", 0)
    with pytest.raises(ValueError, match="'chief' is not a job of the cluster"):
        validate_task({"worker": ["w:1"]}, "chief", 0)
    with pytest.raises(ValueError, match="at most one 'chief' task"):
        validate_task({"chief": ["c:1", "c:2"]}, "chief", 0)
    with pytest.raises(ValueError, match="task_id -1 is out of range"):
        validate_task(CHIEF_CLUSTER, "worker", -1)
    with pytest.raises(ValueError, match="must be a dict or a ClusterSpec"):
        validate_task(["w:1"], "worker", 0)


@given(num_worker_tasks=st.integers(1, 12), chief=st.booleans())
def test_worker_index_is_a_bijection_onto_range(num_worker_tasks, chief):
    cluster = {"worker": [f"w:{i + 1}" for i in range(num_worker_tasks)]}
    tasks = [("worker", i) for i in range(num_worker_tasks)]
    if chief:
        cluster["chief"] = ["c:1"]
        tasks.append(("chief", 0))
    indices = sorted(worker_index(t, i, cluster) for t, i in tasks)
    assert indices == list(range(num_workers(cluster)))
    assert [is_chief(cluster, t, i) for t, i in tasks].count(True) == 1


# ----------------------------------------------------------------------------- SimpleClusterResolver


def test_simple_cluster_resolver_as_tf():
    spec = ClusterSpec({"worker": ["worker0.example.com:2222", "worker1.example.com:2222"]})
    resolver = SimpleClusterResolver(spec, task_type="worker", task_id=1,
                                     num_accelerators={"GPU": 8}, rpc_layer="grpc")
    assert resolver.cluster_spec() is spec
    assert (resolver.task_type, resolver.task_id, resolver.rpc_layer) == ("worker", 1, "grpc")
    assert resolver.master() == "grpc://"  # the constructor's master '' with the rpc layer, as TF
    assert resolver.master("worker", 0) == "grpc://worker0.example.com:2222"
    assert resolver.master("worker", 0, rpc_layer="http") == "http://worker0.example.com:2222"
    assert resolver.num_accelerators() == {"GPU": 8}
    assert resolver.environment == "" and resolver.is_chief is False
    resolver.task_id = 0
    assert resolver.is_chief is True
    plain = SimpleClusterResolver(spec, master="grpc://m:1")
    assert plain.master() == "grpc://m:1" and plain.num_accelerators() == {} and plain.rpc_layer is None


def test_simple_cluster_resolver_type_errors():
    with pytest.raises(TypeError, match=r"cluster_spec must be a ClusterSpec.*wrap it"):
        SimpleClusterResolver({"worker": ["w:1"]})
    with pytest.raises(TypeError, match="master must be a string"):
        SimpleClusterResolver(ClusterSpec({}), master=None)


# ----------------------------------------------------------------------------- Slurm
# Cases from TF's slurm_cluster_resolver_test.py, with a fake environment dict.


@pytest.mark.parametrize("hostlist,expected", [
    ("n1", ["n1"]),
    ("n[1,3]", ["n1", "n3"]),
    ("n[1-3]", ["n1", "n2", "n3"]),
    ("node[1-3,5]", ["node1", "node2", "node3", "node5"]),
    ("n[1-2],m5,o[3-4,6,7-9]", ["n1", "n2", "m5", "o3", "o4", "o6", "o7", "o8", "o9"]),
    ("n[0001-0003],m5,o[009-011]", ["n0001", "n0002", "n0003", "m5", "o009", "o010", "o011"]),
    ("rack[1-2]-n[01-02]", ["rack1-n01", "rack1-n02", "rack2-n01", "rack2-n02"]),
    ("gpu[1-2]-ib", ["gpu1-ib", "gpu2-ib"]),
])
def test_expand_hostlist(hostlist, expected):
    assert expand_hostlist(hostlist) == expected


@pytest.mark.parametrize("hostlist", ["n[1-3", "n1-3]", "n[a-b]", "n[3-1]", "n1,,n2", "n[1-[2]]"])
def test_expand_hostlist_rejects_malformed(hostlist):
    with pytest.raises(ValueError, match="Invalid hostlist format"):
        expand_hostlist(hostlist)


def test_expand_tasks_per_node():
    assert expand_tasks_per_node("2") == [2]
    assert expand_tasks_per_node("2,1,3") == [2, 1, 3]
    assert expand_tasks_per_node("3(x2),2,1") == [3, 3, 2, 1]
    assert expand_tasks_per_node("3(x2),2,11(x4)") == [3, 3, 2, 11, 11, 11, 11]
    with pytest.raises(ValueError, match="Invalid tasks-per-node list format"):
        expand_tasks_per_node("3(2)")


def slurm_env(**values):
    env = {"SLURM_PROCID": "0", "SLURM_STEP_NUM_TASKS": "3",
           "SLURM_STEP_NODELIST": "t02n13,t02n41,t02n43"}
    env.update(values)
    return env


def test_slurm_retrieval_from_env():
    env = slurm_env(SLURM_STEP_TASKS_PER_NODE="1(x3)", CUDA_VISIBLE_DEVICES="0")
    before = os.environ.get("CUDA_VISIBLE_DEVICES")
    resolver = SlurmClusterResolver(env=env)
    assert resolver.cluster_spec() == ClusterSpec(
        {"worker": ["t02n13:8888", "t02n41:8888", "t02n43:8888"]})
    assert resolver.master("worker", 0, rpc_layer="grpc") == "grpc://t02n13:8888"
    assert resolver.num_accelerators() == {"GPU": 1}
    assert env["CUDA_VISIBLE_DEVICES"] == "0"
    assert os.environ.get("CUDA_VISIBLE_DEVICES") == before  # the fake env was used
    assert resolver.get_task_info() == ("worker", 0) and resolver.is_chief


def test_slurm_explicit_jobs_and_master():
    resolver = SlurmClusterResolver(jobs={"ps": 1, "worker": 2}, port_base=8888, tasks_per_node=1,
                                    gpus_per_node=1, gpus_per_task=1, auto_set_gpu=False, env=slurm_env())
    assert resolver.cluster_spec() == ClusterSpec({"ps": ["t02n13:8888"], "worker": ["t02n41:8888", "t02n43:8888"]})
    assert (resolver.task_type, resolver.task_id) == ("ps", 0)
    resolver.task_type, resolver.task_id = "worker", 1
    assert resolver.master() == "grpc://t02n43:8888"
    resolver.rpc_layer = "ab"
    assert resolver.master("ps", 0) == "ab://t02n13:8888"
    assert resolver.master("ps", 0, rpc_layer="test") == "test://t02n13:8888"


def test_slurm_multiple_tasks_per_node_and_gpus():
    env = slurm_env(SLURM_PROCID="1", SLURM_STEP_NUM_TASKS="5", SLURM_STEP_TASKS_PER_NODE="2(x2),1",
                    CUDA_VISIBLE_DEVICES="")
    expected = ClusterSpec({"ps": ["t02n13:8888"],
                            "worker": ["t02n13:8889", "t02n41:8888", "t02n41:8889", "t02n43:8888"]})
    resolver = SlurmClusterResolver(jobs={"ps": 1, "worker": 4}, gpus_per_node=2, gpus_per_task=1, env=env)
    assert resolver.cluster_spec() == expected
    assert env["CUDA_VISIBLE_DEVICES"] == "1"
    assert (resolver.task_type, resolver.task_id) == ("worker", 0)
    resolver = SlurmClusterResolver(jobs={"ps": 1, "worker": 4}, gpus_per_node=4, gpus_per_task=2, env=env)
    assert resolver.cluster_spec() == expected
    assert env["CUDA_VISIBLE_DEVICES"] == "2,3"


def test_slurm_default_gpus_per_task_and_cpu_only_nodes():
    env = slurm_env(SLURM_PROCID="3", SLURM_STEP_NUM_TASKS="4", SLURM_STEP_NODELIST="n[1-2]",
                    SLURM_STEP_TASKS_PER_NODE="2(x2)", CUDA_VISIBLE_DEVICES="0,1,2,3")
    resolver = SlurmClusterResolver(env=env)
    assert resolver.num_accelerators() == {"GPU": 2}
    resolver.cluster_spec()
    assert env["CUDA_VISIBLE_DEVICES"] == "2,3"
    assert (resolver.task_type, resolver.task_id) == ("worker", 3)
    cpu_env = dict(env, CUDA_VISIBLE_DEVICES="")
    resolver = SlurmClusterResolver(env=cpu_env)
    assert resolver.num_accelerators() == {"GPU": 0}
    assert resolver.cluster_spec().as_dict() == {"worker": ["n1:8888", "n1:8889", "n2:8888", "n2:8889"]}
    assert cpu_env["CUDA_VISIBLE_DEVICES"] == ""


def test_slurm_errors():
    with pytest.raises(RuntimeError, match="SLURM_PROCID not found in environment"):
        SlurmClusterResolver(env={})
    with pytest.raises(RuntimeError, match="SLURM_STEP_TASKS_PER_NODE not found"):
        SlurmClusterResolver(gpus_per_node=0, env=slurm_env())
    with pytest.raises(RuntimeError, match="Requested 4 tasks .* but only 3 were assigned"):
        SlurmClusterResolver(jobs={"worker": 4}, tasks_per_node=1, gpus_per_node=0, env=slurm_env())
    with pytest.raises(RuntimeError, match="Requested more GPUs per node than available"):
        SlurmClusterResolver(tasks_per_node=2, gpus_per_node=2, gpus_per_task=2,
                             env=slurm_env(SLURM_STEP_NUM_TASKS="6"))
    with pytest.raises(ValueError, match="job 'trainer', which is not a task type"):
        SlurmClusterResolver(jobs={"trainer": 3}, tasks_per_node=1, gpus_per_node=0, env=slurm_env())
    with pytest.raises(ValueError, match="SLURM_PROCID is 'x', which is not an integer"):
        SlurmClusterResolver(env=slurm_env(SLURM_PROCID="x"))


# -- which resolver MultiWorkerMirroredStrategy() uses -----------------------------------------------
SRUN_2_TASKS = {  # what `srun -N1 -n2` sets for rank 1 (the variables the resolver reads)
    "SLURM_JOB_ID": "42", "SLURM_STEP_ID": "0", "SLURM_PROCID": "1", "SLURM_STEP_NUM_TASKS": "2",
    "SLURM_STEP_NODELIST": "node[1-2]", "SLURM_STEP_TASKS_PER_NODE": "1(x2)",
}


def test_default_resolver_order_tf_config_then_slurm_then_single_worker():
    from distribute.cluster import SlurmClusterResolver, TFConfigClusterResolver
    from distribute.cluster.detect import default_resolver, in_slurm_step

    slurm = default_resolver(dict(SRUN_2_TASKS))
    assert isinstance(slurm, SlurmClusterResolver) and in_slurm_step(dict(SRUN_2_TASKS))
    assert slurm.cluster_spec().as_dict() == {"worker": ["node1:8888", "node2:8888"]}
    assert (slurm.task_type, slurm.task_id) == ("worker", 1)

    tf_config = '{"cluster": {"worker": ["a:1", "b:2"]}, "task": {"type": "worker", "index": 0}}'
    explicit = default_resolver({**SRUN_2_TASKS, "TF_CONFIG": tf_config})  # TF_CONFIG wins over Slurm
    assert isinstance(explicit, TFConfigClusterResolver) and explicit.cluster_spec().as_dict() == {"worker": ["a:1", "b:2"]}

    one_task = {**SRUN_2_TASKS, "SLURM_STEP_NUM_TASKS": "1", "SLURM_PROCID": "0"}
    assert not in_slurm_step(one_task) and not in_slurm_step({"SLURM_JOB_ID": "42"})  # an allocation, not a step
    alone = default_resolver(one_task)
    assert isinstance(alone, TFConfigClusterResolver)
