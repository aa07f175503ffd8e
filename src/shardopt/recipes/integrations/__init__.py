"""Adapters that train with :class:`~shardopt.DistributedOptimizer` inside the frameworks, at
any number of ranks, with the framework's own launcher, clipping, accumulation, mixed
precision and checkpoints:

* :mod:`shardopt.recipes.integrations.lightning`: ``Trainer(strategy=ShardoptStrategy())``.
* :mod:`shardopt.recipes.integrations.accelerate`: ``prepare(accelerator, model, optimizer, ...)``
  in place of ``accelerator.prepare``.
* :mod:`shardopt.recipes.integrations.transformers`: ``ShardoptTrainer`` in place of ``Trainer``.

Each keeps the model unwrapped (the optimizer reduces the gradients itself), maps the
framework's "skip the gradient sync of this micro-batch" to ``optimizer.no_sync()``, and
saves and loads every rank's optimizer state through :mod:`shardopt.checkpoint` inside the
framework's checkpoint (loadable at another number of ranks). Importing this package imports
no framework; each module imports its own, which must be installed (docs/integrations.md).
Like the reference job beside it, it uses the library from outside, through ``shardopt`` and
:mod:`shardopt.checkpoint`, and nothing in the library imports it (``tests/core/test_layering.py``).
"""
