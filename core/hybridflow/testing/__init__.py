"""Test support shipped with hybridflow: tiny real fixtures and the contract suites every engine plugin runs.

Nothing here is a mock: the fixtures build real (tiny) HF models and a real tokenizer locally, with no hub access.
"""
