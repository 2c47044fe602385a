"""A student initialised from its teacher (student/train/init.py): exactly the named tensors
are copied, the extra encoder layers are identities, so the untrained student's encoder is
the teacher's bit for bit; presets that do not map are one clear error; the trainer and
the distill pipeline apply and record it."""
import os
import subprocess
import sys

import pytest
import torch

from conftest import ROOT
from test_distill import distill, env, manifest  # noqa: F401  (env is a fixture)
from test_train import run_train
from student.modeldir import write_model_dir
from student.model import PRESETS, Transformer, preset
from student.train.init import InitError, init_from_teacher, pick_layers, plan

SMALL = dict(vocab_size=64, d_model=32, n_heads=2, ffn_dim=64)


def teacher_dir(tmp_path, spm_path, enc=2, dec=3, seed=0, **over):
    torch.manual_seed(seed)
    t = Transformer(preset("teacher-tiny", **{**SMALL, "encoder_layers": enc, "decoder_layers": dec,
                                              "dropout": 0.0, **over}))
    with torch.no_grad():  # no zero and no 1 anywhere, so no copied tensor can pass for a kept one
        for p in t.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    return write_model_dir(t, spm_path, str(tmp_path / f"teacher{seed}"), {"src_lang": "en", "tgt_lang": "es"}), t


def student(seed=5, enc=3, dec=1, **over):
    torch.manual_seed(seed)
    return Transformer(preset("student-tiny", **{**SMALL, "encoder_layers": enc, "decoder_layers": dec,
                                                 "dropout": 0.0, **over}))


def test_default_presets_map_embeddings_all_encoder_layers_first_decoder_layer_and_norms():
    s = preset("student-tiny", vocab_size=8000)
    t = preset("teacher-tiny", vocab_size=8000)
    p = plan(s, t)
    assert p.layers == {"encoder": [0, 1, 2, 3, None, None], "decoder": [0]}
    copied = dict(p.copy)
    assert copied["shared.weight"] == "shared.weight"
    assert copied["decoder.layers.0.encoder_attn.k_proj.weight"] == "decoder.layers.0.encoder_attn.k_proj.weight"
    assert copied["encoder.layers.3.fc1.bias"] == "encoder.layers.3.fc1.bias"
    assert {"encoder.layer_norm.weight", "decoder.layer_norm.bias"} <= set(copied)
    assert not any(k.startswith(("encoder.layers.4.", "encoder.layers.5.")) for k in copied)
    assert sorted(p.zero) == sorted(f"encoder.layers.{i}.{n}.{w}" for i in (4, 5)
                                    for n in ("self_attn.out_proj", "fc2") for w in ("weight", "bias"))
    assert PRESETS["student-tiny"]["d_model"] == PRESETS["teacher-tiny"]["d_model"]


def test_layer_choice_is_first_or_last_for_one_layer_and_evenly_spaced_otherwise():
    assert pick_layers(1, 3) == [0] and pick_layers(1, 3, "last") == [2]
    assert pick_layers(3, 12) == [0, 6, 11] and pick_layers(6, 12) == [0, 2, 4, 7, 9, 11]
    assert pick_layers(3, 2) == [0, 1, None] and pick_layers(2, 2) == [0, 1]


def test_untrained_student_reproduces_the_teachers_encoder_output_bit_for_bit(tiny_spm, tmp_path):
    tdir, teacher = teacher_dir(tmp_path, tiny_spm, enc=2)
    s = student(enc=4)  # two copied layers, then two identity layers
    init_from_teacher(s, tdir, spm_model=tiny_spm)
    src = torch.randint(4, 64, (3, 11))
    src[1, 7:] = 1  # padding, so the masks take part
    with torch.no_grad():
        want, _ = teacher.eval().encode(src)
        got, _ = s.eval().encode(src)
    assert torch.equal(got, want)
    # the decoder starts from the teacher's first layer: the one-layer teacher restricted to it agrees too
    with torch.no_grad():
        t1 = Transformer(preset("teacher-tiny", **{**SMALL, "encoder_layers": 2, "decoder_layers": 1, "dropout": 0.0}))
        sd = teacher.state_dict()
        t1.load_state_dict({k: v for k, v in sd.items() if not k.startswith(("decoder.layers.1.", "decoder.layers.2."))})
        tgt = torch.randint(4, 64, (3, 6))
        assert torch.equal(s(src, tgt), t1.eval()(src, tgt))


def test_initialisation_copies_exactly_the_named_tensors_and_keeps_the_others_random(tiny_spm, tmp_path):
    tdir, teacher = teacher_dir(tmp_path, tiny_spm, enc=2, dec=3)
    random_init = student(seed=5, enc=3).state_dict()
    s = student(seed=5, enc=3)
    p = init_from_teacher(s, tdir, spm_model=tiny_spm, one="last")
    t_sd, s_sd = teacher.state_dict(), s.state_dict()
    copied, zero = dict(p.copy), set(p.zero)
    assert copied["decoder.layers.0.fc1.weight"] == "decoder.layers.2.fc1.weight"  # one="last"
    for name, value in s_sd.items():
        if name in copied:
            assert torch.equal(value, t_sd[copied[name]]), name
        elif name in zero:
            assert not value.any(), name
        else:
            assert torch.equal(value, random_init[name]), name
    kept = [n for n in s_sd if n not in copied and n not in zero]
    assert kept and all(n.startswith("encoder.layers.2.") for n in kept)
    assert len(copied) + len(zero) + len(kept) == len(s_sd)


@pytest.mark.parametrize("over, named", [(dict(d_model=48), "d_model 32 vs 48"),
                                         (dict(n_heads=4), "n_heads 2 vs 4"),
                                         (dict(ffn_dim=128), "ffn_dim 64 vs 128")])
def test_presets_that_do_not_map_are_one_error_naming_every_difference(tiny_spm, tmp_path, over, named):
    tdir, _ = teacher_dir(tmp_path, tiny_spm, **over)
    s = student()
    before = {k: v.clone() for k, v in s.state_dict().items()}
    with pytest.raises(InitError) as e:
        init_from_teacher(s, tdir, spm_model=tiny_spm)
    msg = str(e.value)
    assert "\n" not in msg and named in msg and "do not map" in msg
    assert all(torch.equal(before[k], v) for k, v in s.state_dict().items())  # nothing half-copied


def test_another_vocabulary_of_the_same_size_is_refused(tiny_spm, tmp_path):
    tdir, _ = teacher_dir(tmp_path, tiny_spm)
    other = tmp_path / "other.model"
    data = bytearray(open(tiny_spm, "rb").read())
    data[-1] ^= 1
    other.write_bytes(bytes(data))
    with pytest.raises(InitError, match="SentencePiece model .* is not the student's"):
        init_from_teacher(student(), tdir, spm_model=str(other))


def test_vocabulary_size_mismatch_is_named(tmp_path):
    s, t = preset("student-tiny", vocab_size=8000), preset("teacher-tiny", vocab_size=32000)
    with pytest.raises(InitError, match="vocab_size 8000 vs 32000"):
        plan(s, t)


# -- the trainer and the pipeline apply it -----------------------------------------------------------

def test_train_init_from_starts_at_the_teacher_and_a_resume_keeps_its_own_weights(toy_files, tmp_path):
    common = ["--eval-every", "0", "--no-test", "--max-tokens", "300"]
    run_train(toy_files, tmp_path / "data", tmp_path / "t", "--max-steps", "3", *common)
    from student.export import export_checkpoint
    tdir = export_checkpoint(str(tmp_path / "t" / "last.pt"), str(tmp_path / "t" / "model"))
    # a 2-layer encoder from the 1-layer teacher, one step at a negligible learning rate
    s = [*common, "--set", "encoder_layers=2", "--init-from", tdir, "--lr", "1e-9"]
    r = run_train(toy_files, tmp_path / "data", tmp_path / "s", "--max-steps", "1", *s)
    assert "initialised from" in r.stdout and "encoder layers <- teacher [0, id]" in r.stdout
    teacher = torch.load(tmp_path / "t" / "last.pt", weights_only=True)["model"]
    got = torch.load(tmp_path / "s" / "last.pt", weights_only=True)["model"]
    for name in ("shared.weight", "encoder.layers.0.fc1.weight", "decoder.layers.0.encoder_attn.v_proj.weight",
                 "decoder.layer_norm.weight"):
        assert torch.allclose(got[name], teacher[name], atol=1e-6), name
    assert got["encoder.layers.1.fc2.weight"].abs().max() < 1e-6  # the identity layer
    r = run_train(toy_files, tmp_path / "data", tmp_path / "s", "--max-steps", "2", *s)
    assert "resuming from" in r.stdout + r.stderr and "initialised from" not in r.stdout
    r = subprocess.run([sys.executable, "-m", "student.train", "--out", str(tmp_path / "bad"), "--src",
                        str(toy_files / "train.en"), "--tgt", str(toy_files / "train.es"), "--src-lang", "en",
                        "--tgt-lang", "es", "--preset", "student-tiny", "--set", "d_model=48", "--set",
                        "n_heads=2", "--set", "ffn_dim=64", "--vocab-size", "320", "--init-from", tdir,
                        "--max-steps", "1"],
                       cwd=ROOT, env={**os.environ, "KIT_DATA_DIR": str(tmp_path / "data"), "OMP_NUM_THREADS": "1"},
                       capture_output=True, text=True, timeout=300)
    assert r.returncode != 0 and "Traceback" not in r.stderr
    assert r.stderr.strip().splitlines()[-1].startswith("error: the student's and the teacher's architectures "
                                                        "do not map") and "d_model 48 vs 32" in r.stderr


def test_distill_starts_the_student_from_its_own_teacher_records_it_and_keys_the_stage_by_it(env):  # noqa: F811
    common = ["--teacher-steps", "10", "--student-steps", "4", "--shortlist-k", "0", "--test-limit", "5",
              "--min-ratio", "0", "--max-ratio", "1000", "--max-repeat", "1000",  # keep an untrained teacher's output
              "--min-teacher-bleu", "0", "--min-kept", "0"]
    r = distill(env, "init", *common)
    m = manifest(env, "init")
    assert m["student_init"] == {"mode": "teacher", "from": os.path.realpath(env / "runs" / "init" /
                                                                          os.readlink(env / "runs" / "init" /
                                                                                      "teacher-model"))}
    assert m["stages"]["student"]["options"]["init"] == "teacher" and m["config"]["student_init"] == "auto"
    assert m["stages"]["student"]["result"]["init"] == "teacher"
    teacher_key = m["stages"]["student"]["key"]
    distill(env, "init", *common, "--student-init", "random")
    m = manifest(env, "init")
    assert m["student_init"] == {"mode": "random", "reason": "--student-init random"}
    assert m["stages"]["teacher"]["status"] == "reused" and m["stages"]["student"]["status"] == "ran"
    assert m["stages"]["student"]["key"] != teacher_key
    # an explicit --student-init teacher is the same stage as auto's choice
    distill(env, "init", *common, "--student-init", "teacher")
    assert manifest(env, "init")["stages"]["student"]["key"] == teacher_key


def test_distill_with_a_command_teacher_starts_random_saying_why_and_refuses_an_explicit_teacher_init(env):  # noqa: F811
    cmd = f"{sys.executable} -c \"import sys; sys.stdout.write(sys.stdin.read().upper())\""
    common = ["--teacher-cmd", cmd, "--student-steps", "2", "--shortlist-k", "0", "--test-limit", "3"]
    r = distill(env, "cmd", *common)
    why = [x for x in r.stderr.splitlines() if "random initialisation" in x]
    assert len(why) == 1 and "not one model dir of ours" in why[0]
    assert manifest(env, "cmd")["student_init"]["mode"] == "random"
    r = distill(env, "cmd", *common, "--student-init", "teacher", check=False)
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert r.stderr.strip().splitlines()[-1].startswith("error: --student-init teacher: the teacher is not")
