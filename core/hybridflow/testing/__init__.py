"""Test support shipped with hybridflow: tiny real fixtures, the contract suites every engine plugin runs and a real
multi-node Ray cluster on loopback (:mod:`hybridflow.testing.ray_cluster`).

Nothing here is a mock: the fixtures build real (tiny) HF models and a real tokenizer locally, with no hub access.
"""
