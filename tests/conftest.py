"""Test setup: the JAX backend for Keras and 8 virtual CPU devices, before JAX loads."""

import os
import re

os.environ["KERAS_BACKEND"] = "jax"
os.environ.setdefault("JAX_PLATFORMS", "cpu")
_flags = os.environ.get("XLA_FLAGS", "")
if "xla_force_host_platform_device_count" not in _flags:
    os.environ["XLA_FLAGS"] = (_flags + " --xla_force_host_platform_device_count=8").strip()


import pytest  # noqa: E402


@pytest.fixture(scope="session")
def ray_instance():
    """One local Ray instance for every ParameterServerStrategy test (start-up costs seconds); shut down at the end."""
    import ray

    from distribute.parameter_server import loopback

    if not ray.is_initialized():
        loopback.init_local()  # every listener on 127.0.0.1, as the embedded head (tests/test_ps_loopback.py)
    yield ray
    ray.shutdown()


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items):
    """Under pytest-xdist (``-n``, pyproject's addopts): which tests run in the same worker process.

    ``--dist loadgroup`` sends the tests of one ``xdist_group`` to one worker.  Every test that starts or
    joins Ray is in group "ray", so the suite starts one local Ray instance, not one per worker, and no two
    Ray clusters start at the same moment: the tests that use the ``ray_instance`` fixture, those of a module
    that makes a ParameterServerStrategy in this process or launches a ps cluster (a ``test_ps_*`` module that
    names Ray, a cluster or a launch; the pure ones, e.g. the rows analysis and the partitioners, are grouped
    by module like any other), and those marked ``xdist_group("ray")`` themselves.  Every other test is grouped by its module, so a module's
    fixtures (a multi-worker launch is tens of seconds) are set up once, in one worker.
    """
    in_ray: dict = {}
    for item in items:
        path = getattr(item, "path", None)
        if path is not None and path not in in_ray:
            text = path.read_text()
            in_ray[path] = "ParameterServerStrategy(" in text or (
                path.name.startswith("test_ps_") and re.search(r"\bray\b|ray_instance|[Ll]aunch|Cluster", text) is not None)
        if any(mark.args == ("ray",) for mark in item.iter_markers("xdist_group")):
            continue
        if "ray_instance" in getattr(item, "fixturenames", ()) or in_ray.get(path):
            item.add_marker(pytest.mark.xdist_group("ray"))
        elif path is not None:
            item.add_marker(pytest.mark.xdist_group(path.stem))
