"""Reading checkpoint files without running code: every pickle-bearing file an engine's checkpoint holds goes through
:mod:`~hybridflow.checkpoint_files.safe_load` (``torch.load(weights_only=True)`` or a restricted unpickler over an
allow-list) or :mod:`~hybridflow.checkpoint_files.safe_dcp` (torch DCP's ``.metadata`` and ``.distcp`` items).

This package wraps pickle's and torch's own loaders, reaching into their internals where the check needs it (the
pure-Python unpickler's opcodes, torch's allow-list); what a checkpoint holds and when it is written or resumed is
the engines' and :mod:`hybridflow.trainer.checkpoint`'s business. Stability: developer.
"""
