"""A GPT's per-layer parameters, FLOPs and activation bytes, derived from Megatron args.

Activation accounting follows the usual per-layer breakdown of a Megatron GPT layer
(bf16 tensors kept for backward, one-byte dropout masks), generalised to any FFN width,
SwiGLU and grouped-query attention; with flash attention the s^2 score terms vanish.
Inside tensor-parallel regions tensors are split over TP; with sequence parallelism
everything is.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

SHAPE_KEYS = (
    "num_layers", "hidden_size", "num_attention_heads", "ffn_hidden_size", "group_query_attention",
    "num_query_groups", "kv_channels", "seq_length", "micro_batch_size", "global_batch_size",
    "padded_vocab_size", "vocab_size", "swiglu", "add_bias_linear", "normalization",
    "position_embedding_type", "max_position_embeddings", "use_flash_attn", "attention_backend",
    "sequence_parallel", "tensor_model_parallel_size", "bf16", "fp16",
)
"""The Megatron args ``ModelShape.from_args`` reads."""


@dataclass(frozen=True, kw_only=True)
class ModelShape:
    num_layers: int
    hidden_size: int
    num_attention_heads: int
    ffn_hidden_size: int
    num_query_groups: int
    kv_channels: int
    seq_length: int
    micro_batch_size: int
    global_batch_size: int
    vocab_size: int
    swiglu: bool = False
    add_bias_linear: bool = True
    rms_norm: bool = False
    learned_position_embeddings: bool = True
    max_position_embeddings: int = 0
    flash_attention: bool = False
    sequence_parallel: bool = False
    tp: int = 1
    bf16: bool = True

    def __post_init__(self) -> None:
        for name in ("num_layers", "hidden_size", "num_attention_heads", "ffn_hidden_size",
                     "num_query_groups", "kv_channels", "seq_length", "micro_batch_size",
                     "global_batch_size", "vocab_size", "tp"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)}: must be >= 1")

    @classmethod
    def from_args(cls, args: Mapping[str, Any]) -> "ModelShape":
        """From a Megatron-style argument dict (the trainer's run record)."""
        def get(name: str, default: Any = None) -> Any:
            value = args.get(name)
            return default if value is None else value

        for key in ("num_layers", "hidden_size", "num_attention_heads", "seq_length",
                    "micro_batch_size", "global_batch_size"):
            if get(key) is None:
                raise ValueError(f"Megatron args lack {key!r}")
        h, heads = int(get("hidden_size")), int(get("num_attention_heads"))
        vocab = get("padded_vocab_size", get("vocab_size"))
        if vocab is None:
            raise ValueError("Megatron args lack 'padded_vocab_size' and 'vocab_size'")
        gqa = bool(get("group_query_attention", False))
        backend = str(get("attention_backend", "")).lower()
        return cls(
            num_layers=int(get("num_layers")), hidden_size=h, num_attention_heads=heads,
            ffn_hidden_size=int(get("ffn_hidden_size", 4 * h)),
            num_query_groups=int(get("num_query_groups", heads)) if gqa else heads,
            kv_channels=int(get("kv_channels", h // heads)),
            seq_length=int(get("seq_length")), micro_batch_size=int(get("micro_batch_size")),
            global_batch_size=int(get("global_batch_size")), vocab_size=int(vocab),
            swiglu=bool(get("swiglu", False)), add_bias_linear=bool(get("add_bias_linear", True)),
            rms_norm=str(get("normalization", "LayerNorm")) == "RMSNorm",
            learned_position_embeddings=get("position_embedding_type", "learned_absolute")
            == "learned_absolute",
            max_position_embeddings=int(get("max_position_embeddings", get("seq_length"))),
            flash_attention=bool(get("use_flash_attn", False)) or "flash" in backend,
            sequence_parallel=bool(get("sequence_parallel", False)),
            tp=int(get("tensor_model_parallel_size", 1)), bf16=bool(get("bf16", False))
            or bool(get("fp16", False)),
        )

    # -- sizes --------------------------------------------------------------------------
    @property
    def _q(self) -> int:
        return self.num_attention_heads * self.kv_channels

    @property
    def _kv(self) -> int:
        return self.num_query_groups * self.kv_channels

    @property
    def _fc1_out(self) -> int:
        return self.ffn_hidden_size * (2 if self.swiglu else 1)

    def layer_params(self) -> int:
        h, q, kv, f1, f = self.hidden_size, self._q, self._kv, self._fc1_out, self.ffn_hidden_size
        weights = h * (q + 2 * kv) + q * h + h * f1 + f * h
        bias = (q + 2 * kv + h + f1 + h) if self.add_bias_linear else 0
        norms = 2 * (h if self.rms_norm else 2 * h)
        return weights + bias + norms

    def embedding_params(self) -> int:
        pos = self.max_position_embeddings if self.learned_position_embeddings else 0
        return (self.vocab_size + pos) * self.hidden_size

    def output_params(self) -> int:
        """The output projection (a copy of the embedding on the last stage when tied)."""
        return self.vocab_size * self.hidden_size

    # -- FLOPs of one microbatch's forward, whole layer (all TP ranks) ------------------
    @property
    def _tokens(self) -> int:
        return self.seq_length * self.micro_batch_size

    def layer_flops(self) -> float:
        h, q, kv, f1, f = self.hidden_size, self._q, self._kv, self._fc1_out, self.ffn_hidden_size
        linear = 2 * self._tokens * (h * (q + 2 * kv) + q * h + h * f1 + f * h)
        attention = 4 * self.micro_batch_size * self.seq_length ** 2 * q
        return float(linear + attention)

    def output_flops(self) -> float:
        return float(2 * self._tokens * self.hidden_size * self.vocab_size)

    # -- activation bytes of one microbatch, per TP rank -------------------------------
    def layer_activation_bytes(self) -> float:
        t, sbh = self.tp, self._tokens * self.hidden_size
        sb, a, s, b = self._tokens, self.num_attention_heads, self.seq_length, self.micro_batch_size
        replicated = 2 * sbh * 2 + 2 * sbh + 2 * sbh  # 2 norm inputs, qkv and fc1 inputs
        masks = 2 * sbh  # dropout masks after attention and MLP (1 byte)
        split = 2 * sb * (self._q + self._kv) + 2 * sb * self._kv + 2 * sb * self._q \
            + 2 * sb * self._fc1_out + 2 * sb * self.ffn_hidden_size
        if not self.flash_attention:
            split += 5 * a * s * s * b  # softmax output, its dropout mask and output
        if self.sequence_parallel:
            return (replicated + masks + split) / t
        return replicated + masks + split / t

    def embedding_activation_bytes(self) -> float:
        sbh = self._tokens * self.hidden_size
        return 3 * sbh / (self.tp if self.sequence_parallel else 1)

    def output_activation_bytes(self) -> float:
        """Final-norm input plus fp32 logits for the loss."""
        sbh = self._tokens * self.hidden_size
        return 2 * sbh / (self.tp if self.sequence_parallel else 1) \
            + 4 * self._tokens * self.vocab_size / self.tp

    def boundary_bytes(self) -> float:
        """Activation sent between stages per microbatch and TP rank (bf16)."""
        return 2 * self._tokens * self.hidden_size / (self.tp if self.sequence_parallel else 1)

    def bytes_per_param(self) -> tuple[int, int]:
        """(m_p, m_o): model weights in bf16 with fp32 master weights and Adam moments, or
        fp32 weights with Adam moments."""
        return (2, 12) if self.bf16 else (4, 8)
