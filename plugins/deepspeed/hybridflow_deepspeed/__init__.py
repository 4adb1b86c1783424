"""hybridflow-deepspeed: a hybridflow plugin (see plugin.py for what it registers)."""

__version__ = "0.1.0"
