"""Helpers for the checkpoint fault-injection suites (tests/checkpoint/test_reliability.py,
tests/checkpoint/test_commit_protocol.py, test_rollback.py).

``common`` builds small models whose state is a function of a seed and edits
checkpoints on disk; ``ranks`` holds the functions that run inside spawned
ranks (save failures, failed loads, kill -9 targets, concurrent jobs).
"""
