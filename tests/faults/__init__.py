"""Helpers for the checkpoint fault-injection suites (tests/test_reliability.py,
tests/test_commit_protocol.py, tests/test_rollback.py).

``common`` builds small models whose state is a function of a seed and edits
checkpoints on disk; ``ranks`` holds the functions that run inside spawned
ranks (save failures, failed loads, kill -9 targets, concurrent jobs).
"""
