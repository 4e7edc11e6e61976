"""Every place the pack replaces or reaches into private parts of a third-party library, one module per library.

Each patch is a small named function with its reason (and the upstream issue, where one exists) in one line,
refuses an untested release through a predicate of :mod:`lightning_dist._compat`, and has a unit test of
its own in ``tests/unit``.
"""
