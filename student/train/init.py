"""A student initialised from its teacher ("shrink and fine-tune", Shleifer & Rush 2020,
the recipe of distilBART): the student starts from the teacher's embeddings, encoder,
a subset of its decoder layers and its final layer norms, and fine-tunes on the
distilled corpus instead of learning from scratch.

The mapping is an explicit list of (student tensor, teacher tensor) pairs (`plan`):
- every tensor outside the layers (embeddings, tied or untied output projection,
  the two final layer norms) is copied;
- a student stack at least as deep as the teacher's takes the teacher's layers in
  order, and each extra layer starts as the identity: its residual branches' output
  projections (attention out_proj, fc2) are zeroed, the rest keeps its random init.
  Pre-norm layers then add exactly 0, so the student computes the teacher's function
  bit for bit until training moves the new layers;
- a shallower student stack takes evenly spaced teacher layers, the first and the
  last among them (Shleifer & Rush); a one-layer stack takes the teacher's first
  (`one="first"`, distilBART's choice and our measured default, docs/distill.md)
  or its last (`one="last"`).
Teacher weights are read from a model dir (safetensors, validated by decoder.modeldir):
no pickle from outside the run is ever loaded.
"""
from __future__ import annotations

import filecmp
import os
from dataclasses import dataclass

import torch

from decoder import modeldir
from student.model import ModelArgs, Transformer
from student.modeldir import model_args

# fields that must agree for the copied tensors to mean the same thing in the student
SAME = ("vocab_size", "d_model", "n_heads", "ffn_dim", "activation", "tie_embeddings", "layer_norm_eps",
        "pad_id", "eos_id", "decoder_start_id")
RESIDUAL_OUT = ("self_attn.out_proj", "encoder_attn.out_proj", "fc2")


class InitError(ValueError):
    """A student that cannot start from this teacher; str(e) is one line saying why."""


@dataclass
class Plan:
    copy: list[tuple[str, str]]  # (student tensor, teacher tensor)
    zero: list[str]              # student tensors set to 0 (the extra layers' residual outputs)
    layers: dict                 # {"encoder": [teacher layer or None per student layer], "decoder": [...]}

    def describe(self) -> str:
        def show(m):
            return "[" + ", ".join("id" if j is None else str(j) for j in m) + "]"
        return (f"{len(self.copy)} tensors copied; student encoder layers <- teacher {show(self.layers['encoder'])}, "
                f"decoder <- {show(self.layers['decoder'])} (id = identity layer)")


def pick_layers(n_student: int, n_teacher: int, one: str = "first") -> list[int | None]:
    """The teacher layer each student layer starts from; None = an identity layer."""
    if n_student >= n_teacher:
        return list(range(n_teacher)) + [None] * (n_student - n_teacher)
    if n_student == 1:
        return [0 if one == "first" else n_teacher - 1]
    return [round(i * (n_teacher - 1) / (n_student - 1)) for i in range(n_student)]


def shapes(a: ModelArgs) -> dict[str, tuple[int, ...]]:
    """Every tensor of a model of these arguments (its state_dict, the model dir's table)."""
    return modeldir.tensor_shapes(modeldir.Arch(**a.arch_dict()))


def plan(s: ModelArgs, teacher: ModelArgs, one: str = "first") -> Plan:
    """The explicit mapping from a model of `teacher`'s arguments into one of `s`'s; InitError if none."""
    diff = [f"{k} {getattr(s, k)} vs {getattr(teacher, k)}" for k in SAME if getattr(s, k) != getattr(teacher, k)]
    if diff:
        raise InitError("the student's and the teacher's architectures do not map (student vs teacher: "
                        + ", ".join(diff) + ")")
    if one not in ("first", "last"):
        raise InitError(f"one-layer mapping must be 'first' or 'last', not {one!r}")
    names = list(shapes(s))
    layers = {"encoder": pick_layers(s.encoder_layers, teacher.encoder_layers, one),
              "decoder": pick_layers(s.decoder_layers, teacher.decoder_layers, one)}
    copy, zero = [], []
    for name in names:
        parts = name.split(".")
        if parts[1:2] != ["layers"]:
            copy.append((name, name))  # embeddings, output projection, final layer norms
            continue
        j = layers[parts[0]][int(parts[2])]
        rest = ".".join(parts[3:])
        if j is not None:
            copy.append((name, ".".join(parts[:2] + [str(j)] + parts[3:])))
        elif rest.rsplit(".", 1)[0] in RESIDUAL_OUT:
            zero.append(name)
    t_shapes, s_shapes = shapes(teacher), shapes(s)
    for s_name, t_name in copy:  # the arch check above implies this; it guards the layout
        if s_shapes[s_name] != t_shapes[t_name]:
            raise InitError(f"student {s_name} {s_shapes[s_name]} vs teacher {t_name} {t_shapes[t_name]}")
    return Plan(copy, zero, layers)


def read_teacher(model_dir: str) -> tuple[ModelArgs, dict, str]:
    """(arguments, weights, spm path) of a teacher model dir; InitError if it is not one."""
    try:
        cfg, weights, spm_path = modeldir.load(model_dir)
    except modeldir.ModelDirError as e:
        raise InitError(f"cannot initialise from {model_dir}: {e}") from None
    return model_args(cfg), weights, spm_path


def check_vocabulary(teacher_spm: str, spm_model: str) -> None:
    """The teacher's pieces must be the student's: same ids, same embedding rows."""
    if not filecmp.cmp(teacher_spm, spm_model, shallow=False):
        raise InitError(f"the teacher's SentencePiece model ({teacher_spm}) is not the student's ({spm_model}): "
                        "its embedding rows would belong to other pieces")


@torch.no_grad()
def init_from_teacher(student: Transformer, model_dir: str, spm_model: str | None = None,
                      one: str = "first") -> Plan:
    """Overwrite `student`'s mapped tensors with the teacher's (model dir) and zero the extra
    layers' residual outputs; every other tensor keeps its value. Returns the plan."""
    t_args, weights, t_spm = read_teacher(model_dir)
    if spm_model is not None:
        check_vocabulary(t_spm, spm_model)
    p = plan(student.args, t_args, one)
    sd = student.state_dict()  # views of the parameters: copy_ writes into the model
    for s_name, t_name in p.copy:
        sd[s_name].copy_(weights[t_name])
    for s_name in p.zero:
        sd[s_name].zero_()
    return p


def compatible(student: ModelArgs, model_dir: str, spm_model: str | None = None) -> str | None:
    """None if a student of these arguments can start from the teacher in `model_dir`, else why not."""
    if not os.path.isdir(model_dir):
        return f"{model_dir}: no such model dir"
    try:
        t_args, _, t_spm = read_teacher(model_dir)
        if spm_model is not None:
            check_vocabulary(t_spm, spm_model)
        plan(student, t_args)
    except InitError as e:
        return str(e)
    return None
