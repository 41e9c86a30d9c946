"""Seed examples of pallas kernels, each runnable as a script and importable by the tests.

Every module defines its kernel(s), a wrapper that calls ``pl.pallas_call`` and a ``main()``
that runs the wrapper on random inputs and checks it against plain ``jax.numpy``.
``python examples/run_all.py`` runs every ``main()``.
"""
