"""Sequence-level knowledge distillation: teacher -> distilled corpus -> students -> report.

    from student.distill import DistillConfig, run
    report = run(DistillConfig.from_preset("default", teacher_cmd="apertium -u eng-spa"))

Teachers (teachers.py) share one interface, translate(lines) -> lines; the
source side is translated in resumable shards (shards.py), cleaned
(filter.py), and each stage is keyed by its options (stages.py).
CLI: python -m student.distill --help (docs/distill.md).
"""
from student.distill.pipeline import PRESETS, DistillConfig, run
from student.distill.teachers import CommandTeacher, HFTeacher, ModelTeacher, TeacherError, make_teacher

__all__ = ["DistillConfig", "PRESETS", "run", "CommandTeacher", "HFTeacher", "ModelTeacher", "TeacherError",
           "make_teacher"]
