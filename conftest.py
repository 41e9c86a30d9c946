"""Test setup shared by every test directory: eight host CPU devices for shard_map tests.

It must run before jax is imported, so it lives at the root, where pytest loads it first.
"""

import os

if "--xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (
        os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
    ).strip()
