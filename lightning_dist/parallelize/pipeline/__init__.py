"""Pipeline parallelism: the network's split into stages (``split``), the stages and their schedule."""
