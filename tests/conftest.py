"""Test setup: the JAX backend for Keras and 8 virtual CPU devices, before JAX loads."""

import os

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

    if not ray.is_initialized():
        ray.init(address="local", include_dashboard=False, log_to_driver=False, configure_logging=False)
    yield ray
    ray.shutdown()


def pytest_collection_modifyitems(config, items):
    """Under pytest-xdist (``-n``, pyproject's addopts): every test of the shared Ray instance runs in one worker.

    ``--dist loadgroup`` sends the tests of one ``xdist_group`` to one worker, so the suite starts one local
    Ray instance, not one per worker: the tests that use the ``ray_instance`` fixture, and those of a module
    that makes a ParameterServerStrategy in this process (it would join or start Ray here).
    """
    in_process_ps: dict = {}
    for item in items:
        path = getattr(item, "path", None)
        if path is not None and path not in in_process_ps:
            in_process_ps[path] = "ParameterServerStrategy(" in path.read_text()
        if "ray_instance" in getattr(item, "fixturenames", ()) or in_process_ps.get(path):
            item.add_marker(pytest.mark.xdist_group("ray"))
