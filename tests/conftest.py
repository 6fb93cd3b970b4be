"""Suite-wide isolation: a module that started Ray in-process (a pool, a learner group) leaves no
Ray session behind for the next module, which may want its own `ray.init(...)`."""
import sys

import pytest


@pytest.fixture(autouse=True, scope="module")
def _no_ray_session_across_modules():
    yield
    if "ray" in sys.modules:
        import ray

        if ray.is_initialized():
            ray.shutdown()
