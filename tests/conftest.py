import os

import pytest

DISTRIBUTED_VARS = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


@pytest.fixture(autouse=True, scope="module")
def restore_distributed_env():
    """Tests that build an engine set RANK/MASTER_PORT/... in this process. Put them back afterwards:
    notebook kernels started later by nbval inherit the environment, and would try to bind a port
    this process already holds."""
    saved = {k: os.environ.get(k) for k in DISTRIBUTED_VARS}
    yield
    for key, value in saved.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value
