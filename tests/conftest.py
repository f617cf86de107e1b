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
