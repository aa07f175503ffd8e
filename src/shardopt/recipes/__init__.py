"""The reference training job behind ``shardopt train`` and ``shardopt demo``, apart from the library.

A small GPT (:mod:`.model`) on a synthetic Markov task (:mod:`.data`), its training loop
(:mod:`.train`), the launcher that starts its ranks (:mod:`.launch`) and the demo (:mod:`.demo`);
and the adapters for Lightning, Accelerate and the Hugging Face Trainer (:mod:`.integrations`).
It uses the library through its public API only; the library never imports it.
"""
