"""Where the pack reaches into private parts of a library: one module per library, one named function per patch.

Each patch states its reason and the upstream issue in one line, checks a version predicate of
:mod:`lightning_dist._compat` (refusing clearly on an untested release) and has a unit test of its own.
"""
