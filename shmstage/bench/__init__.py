"""Benchmarks as a library, so ``benchmarks/*.py`` and ``shmstage bench`` share one implementation.

``shmstage.bench.stage``: staging speed of ``shmstage stage`` against cp/rsync/tar and parallel cat.
``shmstage.bench.loader``: DataLoader settings on staged data.
"""
