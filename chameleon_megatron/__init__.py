"""chameleon-megatron: activation swapping and adaptive fault tolerance for Megatron training."""

__version__ = "0.1.0"
