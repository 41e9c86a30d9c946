"""SparseCore examples: an embedding lookup, the scatter-add of its gradient (repeated
indices; once straight into HBM, once accumulated in each core's shared VMEM between subcore
barriers), a segment sum over a ragged batch and a key-value sort, each run in the interpreter
and checked against jax.numpy, then lowered for a TPU v7x's SparseCores (no TPU needed).

Needs the SparseCore plugin: ``pip install -e . -e plugins/pallas_interpret
-e plugins/pallas_mosaic_tpu -e plugins/pallas_sparsecore``; run ``python examples/sparsecore.py``.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from pallas_sparsecore import kernels


def main() -> None:
    k = iter(jax.random.split(jax.random.key(0), 8))
    table = jax.random.normal(next(k), (100, 128))
    idx = jax.random.randint(next(k), (512,), 0, 100)
    grads = jax.random.normal(next(k), (512, 128))
    values = jax.random.normal(next(k), (2048,))
    segments = jnp.sort(jax.random.randint(next(k), (2048,), 0, 64))
    keys = jax.random.randint(next(k), (64, 16), -20, 20)
    vals = jax.random.normal(next(k), (64, 16))
    order = jnp.argsort(keys, axis=1, stable=True)

    runs = {
        "embedding_lookup": (kernels.embedding_lookup, (table, idx), table[idx]),
        "scatter_add": (functools.partial(kernels.scatter_add, num_rows=100), (grads, idx),
                        jnp.zeros((100, 128)).at[idx].add(grads)),
        "scatter_add_shared": (functools.partial(kernels.scatter_add_shared, num_rows=256),
                               (grads, idx), jnp.zeros((256, 128)).at[idx].add(grads)),
        "segment_sum": (functools.partial(kernels.segment_sum, num_segments=64),
                        (values, segments), jax.ops.segment_sum(values, segments, 64)),
        "sort_key_val": (kernels.sort_key_val, (keys, vals),
                         (jnp.take_along_axis(keys, order, 1),
                          jnp.take_along_axis(vals, order, 1))),
    }
    for name, (fn, args, expected) in runs.items():
        out = fn(*args, interpret=True)
        for o, e in zip(jax.tree_util.tree_leaves(out), jax.tree_util.tree_leaves(expected)):
            np.testing.assert_allclose(np.asarray(o), np.asarray(e), rtol=1e-5, atol=1e-5)
        text = jax.jit(functools.partial(fn, target="v7x")).trace(*args).lower(
            lowering_platforms=("tpu",)).as_text()
        assert "tpu_custom_call" in text and "DEVICE_TYPE_SPARSECORE" in text
        print(f"{name}: interpreter matches jax.numpy; lowered for v7x SparseCores")


if __name__ == "__main__":
    main()
