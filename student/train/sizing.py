"""Batch size, learning rate and warm-up per device, decided once before training starts.

The measured recipe (docs/training.md) is a CPU one: 3,072 padded tokens a step,
peak learning rate 2e-3 after 400 warm-up steps. On a GPU that batch starves the
device: student-6-1 trained at 38k tokens/s with it and at 155k with 24,576 on one
H100. So on CUDA the tokens per step come from the free GPU memory and the model's
shape (`gpu_batch_tokens`), and the learning rate and warm-up follow the batch
(`scaled_lr`, `scaled_warmup`). Every value given explicitly wins; on CPU nothing
changes. Pure functions of their arguments, so the tests pin them without a GPU.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

# the measured CPU recipe, the reference the GPU values are scaled from
REF_TOKENS = 3072
REF_SENTENCES = 256
REF_LR = 2e-3
REF_WARMUP = 400

# GPU batch bounds. FLOOR: below it a step is all launch overhead (a tiny card still trains,
# slowly). CEILING: the largest batch measured to pay (155k tokens/s for student-6-1 on one
# H100 at 24,576, 4.1x the CPU batch); past the point where the device is busy a bigger batch
# buys no speed, only fewer optimiser steps, and a 29k-pair corpus has only ~50 steps of
# 24k tokens an epoch. Re-measure with `python -m student.train.speed --device cuda`.
GPU_FLOOR_TOKENS = 1024
GPU_CEILING_TOKENS = 24576
GPU_ROUND = 1024
MEMORY_SHARE = 0.8           # of the free memory: the allocator's fragmentation and cuBLAS workspaces
RESERVE_BYTES = 1 << 30      # CUDA context growth, the dev-BLEU decoder's model copy
MIN_TOKENS_PER_SENTENCE = 8  # GPU sentence cap = tokens / 8: the token budget binds, not the count

# lr: square-root scaling with the batch (for Adam the update's noise shrinks with the square root
# of the batch; Malladi et al. 2022, "On the SDEs and scaling rules for adaptive gradient
# algorithms"; linear scaling is SGD's rule and would give 1.6e-2 at 8x), capped at 1.5x the
# reference: 2e-3 is already at the top of the range pre-norm Transformers train at, nothing above
# it was measured, and the cost is asymmetric: a GPU budget of dozens of epochs absorbs a slower
# start, not a diverged run. Batches at or below the reference keep its lr.
LR_SCALE_CAP = 1.5


@dataclass(frozen=True)
class Shape:
    """What activation memory depends on: per padded token, each layer's width and FFN, and the
    vocabulary (the logits and their gradient dominate for small models)."""
    params: int
    d_model: int
    ffn_dim: int
    encoder_layers: int
    decoder_layers: int
    vocab_size: int

    @classmethod
    def of(cls, args) -> "Shape":
        """From student.model.ModelArgs."""
        d, f, v = args.d_model, args.ffn_dim, args.vocab_size
        enc = 4 * d * d + 2 * d * f
        dec = 8 * d * d + 2 * d * f
        params = args.encoder_layers * enc + args.decoder_layers * dec + v * d * (1 if args.tie_embeddings else 2)
        return cls(params, d, f, args.encoder_layers, args.decoder_layers, v)

    def bytes_per_token(self) -> int:
        """Training activations per padded token, mixed precision. Per layer after Korthikanti et
        al. 2022 (34 x d bytes a token for FFN 4d with 16-bit activations: 15 d attention and
        norms, 19 d the FFN), a decoder layer's cross-attention adding 11 d; doubled, since
        autocast keeps the residual stream and the norms in fp32. Logits: 12 bytes a vocabulary
        entry (16-bit logits, fp32 log-softmax, both gradients)."""
        d, f = self.d_model, self.ffn_dim
        layers = self.encoder_layers * (15 * d + 4.75 * f) + self.decoder_layers * (26 * d + 4.75 * f)
        return int(2 * layers + 12 * self.vocab_size)

    def fixed_bytes(self) -> int:
        """fp32 master weights, their gradients and Adam's two moments: 16 bytes a parameter."""
        return 16 * self.params


def gpu_batch_tokens(free_bytes: int, shape: Shape) -> int:
    """Padded tokens per step for a GPU with `free_bytes` free: what fits in MEMORY_SHARE of it
    after the weights, optimiser state and RESERVE_BYTES, between the floor and the ceiling,
    rounded down to GPU_ROUND. Monotone in free_bytes."""
    usable = free_bytes * MEMORY_SHARE - shape.fixed_bytes() - RESERVE_BYTES
    fits = int(max(usable, 0) // shape.bytes_per_token()) // GPU_ROUND * GPU_ROUND
    return max(GPU_FLOOR_TOKENS, min(GPU_CEILING_TOKENS, fits))


def scaled_lr(tokens: int, ref_lr: float = REF_LR) -> float:
    """Peak learning rate for `tokens` per step: ref_lr x sqrt(tokens / REF_TOKENS), between 1x and
    LR_SCALE_CAP x."""
    return ref_lr * min(max(math.sqrt(tokens / REF_TOKENS), 1.0), LR_SCALE_CAP)


def scaled_warmup(tokens: int, beta2: float = 0.98) -> int:
    """Warm-up steps for `tokens` per step. Warm-up is counted in tokens, the reference's
    400 x 3,072 (about one epoch of the Bible corpus): the same amount of data at any batch.
    At least 2 / (1 - beta2) steps (100 for Adam's 0.98), the warm-up Adam's second-moment
    estimate needs to settle whatever the batch (Ma & Yarats 2021, "On the adequacy of untuned
    warmup for adaptive optimization"). Batches at or below the reference keep its 400 steps."""
    if tokens <= REF_TOKENS:
        return REF_WARMUP
    return max(math.ceil(REF_WARMUP * REF_TOKENS / tokens), math.ceil(2 / (1 - beta2)))


@dataclass(frozen=True)
class Sizes:
    max_tokens: int
    max_sentences: int
    lr: float
    warmup: int
    why: str  # one line for the log: where the batch came from


def resolve(device_type: str, free_bytes: int | None, shape: Shape, max_tokens: int | None = None,
            max_sentences: int | None = None, lr: float | None = None, warmup: int | None = None,
            beta2: float = 0.98) -> Sizes:
    """The run's sizes: each given value as given, each None the device's default. CPU: the
    measured recipe. CUDA: gpu_batch_tokens of the free memory, the lr and warm-up scaled to the
    batch (also to an explicit one, unless lr/warmup are given too)."""
    if max_tokens is not None:
        why = f"{max_tokens} tokens a step (given)"
    elif device_type == "cuda":
        max_tokens = gpu_batch_tokens(free_bytes or 0, shape)
        why = (f"{max_tokens} tokens a step, sized for {(free_bytes or 0) / 2**30:.1f} GiB free GPU memory "
               f"({shape.params / 1e6:.1f} M parameters, about {shape.bytes_per_token() / 1024:.0f} KiB a token)")
    else:
        max_tokens = REF_TOKENS
        why = f"{max_tokens} tokens a step (the CPU recipe)"
    if max_sentences is None:
        max_sentences = max(max_tokens // MIN_TOKENS_PER_SENTENCE, 1) if device_type == "cuda" else REF_SENTENCES
    lr = scaled_lr(max_tokens) if lr is None else lr
    warmup = scaled_warmup(max_tokens, beta2) if warmup is None else warmup
    return Sizes(max_tokens, max_sentences, lr, warmup, why)


def amp_dtype_for(amp: str, device_type: str, cpu_bf16: bool, cuda_bf16: bool):
    """(autocast dtype or None, whether a GradScaler is needed) for cfg.amp. auto: bf16 on CPUs with
    native bf16 and on GPUs that support it (no loss scaling, the fp32 range), fp16 with a scaler on
    older GPUs, fp32 elsewhere. The weights and the optimiser stay fp32 (the master copy)."""
    import torch
    if device_type == "cuda":
        if amp == "bf16" or (amp == "auto" and cuda_bf16):
            return torch.bfloat16, False
        if amp in ("auto", "fp16"):
            return torch.float16, True
        return None, False
    if amp == "bf16" or (amp == "auto" and cpu_bf16):
        return torch.bfloat16, False
    return None, False  # fp16 on CPU: no such autocast; fp32, as before
