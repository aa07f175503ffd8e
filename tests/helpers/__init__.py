"""What the test modules share; no test module imports another.

* :mod:`helpers.dist`: run a function on several ranks in processes of their own
  (:func:`~helpers.dist.run_distributed`), the device of a rank, skips for missing GPUs, and
  the framework tests' runs at two world sizes.
* :mod:`helpers.checks`: comparisons (raw bits, dicts of tensors, a checkpoint's bytes, an
  export, an optimizer's whole state gathered from every rank).
* :mod:`helpers.models`: the models and training runs several modules train.
* :mod:`helpers.offload`: the offload tests' model, its training with round trips of the
  state, and that state.
* :mod:`helpers.muon`: the Muon tests' model and run, and ``torch.optim.Muon`` beside
  ``torch.optim.AdamW`` as their reference.

``tests/`` is on ``sys.path`` (pyproject's pytest ``pythonpath``), and ranks inherit it, so a
rank's function may live here or in a test module. The fault injectors of the checkpoint
tests are the package :mod:`faults`.
"""
