"""The megatron-core GPT trainer behind ``chameleon_megatron.pretrain_gpt``."""
