"""Bad input anywhere in the kit is one `error:` line (exit 2), never a traceback; a closed
stdout pipe ends a command quietly; the image build and the Makefile survive paths with
spaces and quotes; /run.sh refuses arguments it would ignore."""
import gzip
import os
import shlex
import subprocess
import sys
import tarfile

import pytest

from conftest import python_m_each
from fixture_model import make_model_dir

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ENV = dict(os.environ, PYTHONPATH=ROOT)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_model_dir(tmp_path_factory.mktemp("err") / "model", vocab_size=300, d_model=32,
                          enc=1, dec=1, seed=4)


def one_error_line(stderr: str) -> str:
    lines = stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), stderr[-2000:]
    return lines[0]


# -- student.data prepare -----------------------------------------------------------------

@pytest.fixture
def corpus(tmp_path):
    src = "".join(f"the line number {i} here\n" for i in range(3000)).encode()
    tgt = "".join(f"la linea numero {i} aqui\n" for i in range(3000)).encode()
    (tmp_path / "c.es").write_bytes(tgt)
    (tmp_path / "c.en").write_bytes(src)
    gz = gzip.compress(src)
    (tmp_path / "cut.en.gz").write_bytes(gz[:len(gz) // 2])  # a download that stopped half way
    (tmp_path / "dir.en").mkdir()
    return tmp_path


@pytest.mark.parametrize("src,expected", [("missing.en", "missing.en: no such file"),
                                          ("dir.en", "dir.en: is a directory"),
                                          ("cut.en.gz", "cut.en.gz: truncated or corrupt gzip")])
def test_prepare_with_a_bad_src_file_is_one_error_line(corpus, capsys, src, expected):
    from student.data.__main__ import main
    rc = main(["prepare", "--src", str(corpus / src), "--tgt", str(corpus / "c.es"), "--src-lang", "en",
               "--tgt-lang", "es", "--data-dir", str(corpus / "data"), "-q"])
    out = capsys.readouterr()
    assert rc == 2 and out.out == ""
    assert expected in one_error_line(out.err)


# -- a model dir or an input that is not there, in every command ----------------------------

MISSING = {  # case: (module, argv, what the one line says after "error: "); NONE is a path not there
    "decoder --model": ("decoder", ["--model", "NONE"], "--model NONE: model dir does not exist"),
    "decoder --input": ("decoder", ["--model", "MODEL", "--input", "NONE"], "--input NONE: no such file"),
    "decoder --output": ("decoder", ["--model", "MODEL", "--input", "SRC", "--output", "NONE/out"],
                         "--output NONE/out: no such directory NONE"),
    "decoder --shortlist": ("decoder", ["--model", "MODEL", "--input", "SRC", "--shortlist"],
                            "--shortlist: MODEL/config.json: no shortlist listed (files.shortlist); "
                            "build one with python -m student.shortlist"),
    "evaluate --model": ("submission.evaluate", ["--model", "NONE"], "--model NONE: model dir does not exist"),
    "evaluate --teacher": ("submission.evaluate", ["--model", "MODEL", "--teacher", "NONE"],
                           "--teacher NONE: model dir does not exist"),
    "evaluate --model NAME=": ("submission.evaluate", ["--model", "s=NONE"], "--model NONE: model dir does not exist"),
    "evaluate --src": ("submission.evaluate", ["--model", "MODEL", "--src", "NONE", "--ref", "SRC"],
                       "--src NONE: no such file"),
    "evaluate --ref": ("submission.evaluate", ["--model", "MODEL", "--src", "SRC", "--ref", "NONE"],
                       "--ref NONE: no such file"),
    "distill --teacher-model": ("student.distill", ["--teacher-model", "NONE"],
                                "--teacher-model NONE: model dir does not exist"),
    "distill --teacher-hf": ("student.distill", ["--teacher-hf", "NONE"],
                             "--teacher-hf NONE: Hugging Face model dir does not exist"),
    "distill --src": ("student.distill", ["--src", "NONE", "--tgt", "SRC", "--src-lang", "en", "--tgt-lang", "es"],
                      "--src NONE: no such file"),
    "train --init-from": ("student.train", ["--out", "OUT", "--init-from", "NONE"],
                          "--init-from NONE: model dir does not exist"),
    "train --src": ("student.train", ["--out", "OUT", "--src", "NONE", "--tgt", "SRC"], "--src NONE: no such file"),
    "image --model": ("submission.image", ["--model", "NONE"], "--model NONE: model dir does not exist"),
    "shortlist --model": ("student.shortlist", ["--model", "NONE", "--src", "SRC", "--tgt", "SRC"],
                          "--model NONE: model dir does not exist"),
    "shortlist --tgt": ("student.shortlist", ["--model", "MODEL", "--src", "SRC", "--tgt", "NONE"],
                        "--tgt NONE: no such file"),
    "export checkpoint": ("student.export", ["NONE", "OUT"], "NONE: no such checkpoint"),
    "export a directory": ("student.export", ["OUTSIDE", "OUT"], "OUTSIDE: is a directory, not a checkpoint"),
    "chart": ("student.chart", ["NONE", "--out", "OUT"], "NONE: no such file"),
    "bench_chart": ("tools.bench_chart", ["NONE", "--out", "OUT"], "NONE: no such file"),
}


SINGLE_FILE = ("submission.image", "student.export", "student.chart", "tools.bench_chart")


@pytest.mark.parametrize("case", sorted(MISSING))
def test_a_model_dir_or_input_that_is_not_there_is_one_line_naming_its_option(case, model_dir, tmp_path, capsys,
                                                                               monkeypatch):
    import importlib
    module, argv, says = MISSING[case]
    paths = {"NONE": str(tmp_path / "none"), "MODEL": model_dir, "SRC": str(tmp_path / "in.en"),
             "OUTSIDE": str(tmp_path), "OUT": str(tmp_path / "out")}
    (tmp_path / "in.en").write_text("the dog\n")
    fill = lambda text: next((text.replace(k, v) for k, v in paths.items() if k in text), text)  # noqa: E731
    main = importlib.import_module(module if module in SINGLE_FILE else f"{module}.__main__").main
    monkeypatch.setattr(sys, "stdin", open(os.devnull))
    cwd = tmp_path / "cwd"  # where a command's defaults would write (student.distill's runs/)
    cwd.mkdir()
    monkeypatch.chdir(cwd)
    try:
        code = main([fill(x) for x in argv])
    except SystemExit as e:  # a check's refusal in a command whose main lets it through
        code = e.code
    out = capsys.readouterr()
    assert (code, out.out, out.err) == (2, "", f"error: {fill(says)}\n")
    assert not os.path.exists(tmp_path / "out") and not os.path.exists(tmp_path / "none")
    assert not os.listdir(cwd)  # refused before any work: nothing written where it was run


def test_a_model_dir_without_a_file_its_config_lists_is_refused_before_any_work(model_dir, tmp_path, capsys):
    import json
    import shutil
    import submission.evaluate.__main__ as evaluate
    import student.shortlist.__main__ as shortlist
    from tools import bench
    m = tmp_path / "m"
    shutil.copytree(model_dir, m)
    cfg = json.loads((m / "config.json").read_text())
    cfg["files"]["shortlist"] = "shortlist.safetensors"  # copied without the file it lists
    (m / "config.json").write_text(json.dumps(cfg))
    (tmp_path / "in.en").write_text("the dog\n")
    said = f"error: --model {m}/shortlist.safetensors: missing file (listed as files.shortlist in config.json)\n"
    assert evaluate.main(["--model", str(m), "--out", str(tmp_path / "out")]) == 2
    assert capsys.readouterr().err == said
    with pytest.raises(SystemExit):  # the bench's first shortlist row would have met it minutes in
        bench.main(["--model", str(m), "--src", str(tmp_path / "in.en"), "--out", str(tmp_path / "out")])
    assert capsys.readouterr().err == said
    # the command that writes the shortlist is the one that does not need it
    src = str(tmp_path / "in.en")
    assert shortlist.main(["--model", str(m), "--src", src, "--tgt", src]) == 0
    assert (m / "shortlist.safetensors").exists()
    (m / "spm.model").unlink()
    assert evaluate.main(["--model", str(m), "--out", str(tmp_path / "out")]) == 2
    assert capsys.readouterr().err == f"error: --model {m}/spm.model: missing file\n"
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("args, says", [
    (["--teacher-cmd", " "], "--teacher-cmd: an empty command"),  # "" trained a teacher instead
    (["--name", "../elsewhere"], "--name '../elsewhere': a folder name under --runs-dir, without '/'"),
    (["--name", "a/b"], "--name 'a/b': a folder name under --runs-dir"),
    (["--runs-dir", "FILE"], "exists and is not a directory"),  # a traceback when the run dir was made
])
def test_a_run_that_could_not_go_where_it_says_is_refused_before_any_work(args, says, tmp_path, capsys):
    from student.distill.__main__ import options
    (tmp_path / "file").write_text("")
    with pytest.raises(SystemExit) as e:
        options([str(tmp_path / "file") if x == "FILE" else x for x in args])
    err = capsys.readouterr().err.strip().splitlines()
    assert e.value.code == 2 and len(err) == 1 and says in err[0], err


def test_an_output_folder_is_checked_for_a_file_in_its_way(tmp_path):
    from decoder.cliargs import out_dir_error
    (tmp_path / "f").write_text("")
    f = str(tmp_path / "f")
    assert out_dir_error("--out", f) == f"--out {f}: exists and is not a directory"
    assert out_dir_error("--out", f"{f}/a/b") == f"--out {f}/a/b: {f} is a file, not a directory"
    assert out_dir_error(None, f"{f}/a") == f"{f}/a: {f} is a file, not a directory"  # a positional OUT_DIR
    assert out_dir_error("--out", f, file=True) is None  # a file to write over
    assert out_dir_error("--out", f"{f}/x.json", file=True) == f"--out {f}/x.json: {f} is a file, not a directory"
    assert out_dir_error("--out", str(tmp_path / "new" / "deeper")) is None and out_dir_error("--out", ".") is None


OUT_UNDER_A_FILE = {  # module: its argv with FILE/x as the output, which must be refused before any work
    "submission.evaluate": ["--model", "MODEL", "--out", "FILE/x"],
    "student.train": ["--out", "FILE/x"],
    "student.distill": ["--runs-dir", "FILE/x"],
    "tools.convert": ["--to", "ct2", "MODEL", "FILE/x"],
    "tools.synth_corpus": ["--pairs", "3", "--out", "FILE/x"],
    "tools.bench": ["--model", "MODEL", "--src", "SRC", "--out", "FILE/x"],
    "decoder": ["--model", "MODEL", "--input", "SRC", "--output", "FILE/x"],
    "student.data": ["prepare", "--data-dir", "FILE/x"],
}


def test_an_output_below_a_file_is_one_error_line_in_every_command(model_dir, tmp_path):
    (tmp_path / "file").write_text("")
    (tmp_path / "in.en").write_text("the dog\n")
    paths = {"FILE": str(tmp_path / "file"), "MODEL": model_dir, "SRC": str(tmp_path / "in.en")}
    fill = lambda x: next((x.replace(k, v) for k, v in paths.items() if x.startswith(k)), x)  # noqa: E731
    argvs = [[m, *map(fill, argv)] for m, argv in OUT_UNDER_A_FILE.items()]
    for m, (code, out, err) in zip(OUT_UNDER_A_FILE, python_m_each(argvs, env=ENV)):
        assert (code, err.count("\n")) == (2, 1) and err.endswith(f"{tmp_path}/file is a file, not a directory\n"), \
            (m, err)


# -- student.export -----------------------------------------------------------------------

def test_export_of_a_pickle_is_refused_with_one_error_line(tmp_path):
    import pickle
    path = tmp_path / "evil.pt"
    path.write_bytes(pickle.dumps({"model_args": {}, "model": {}, "meta": {}}))
    r = subprocess.run([sys.executable, "-m", "student.export", str(path), str(tmp_path / "out")],
                       capture_output=True, text=True, env=ENV, cwd=ROOT, timeout=120)
    assert r.returncode == 2 and r.stdout == ""
    assert "evil.pt: refused: not a weights-only torch checkpoint" in one_error_line(r.stderr)
    assert not os.path.exists(tmp_path / "out")


def test_export_of_a_torch_file_that_is_no_checkpoint_names_what_is_missing(tmp_path, capsys):
    import torch
    from student.export import main
    torch.save([1, 2, 3], tmp_path / "list.pt")
    assert main([str(tmp_path / "list.pt"), str(tmp_path / "out")]) == 2
    assert "list.pt: not a student.train checkpoint (no 'model_args')" in one_error_line(capsys.readouterr().err)


# -- --teacher-hf -------------------------------------------------------------------------

def test_hf_teacher_dir_without_tokenizer_is_a_teacher_error_before_any_work(tmp_path):
    pytest.importorskip("transformers")
    from transformers import MarianConfig, MarianMTModel
    from student.distill.teachers import TeacherError, make_teacher
    cfg = MarianConfig(vocab_size=64, d_model=16, encoder_layers=1, decoder_layers=1,
                       encoder_attention_heads=2, decoder_attention_heads=2, encoder_ffn_dim=32,
                       decoder_ffn_dim=32, max_position_embeddings=64, pad_token_id=1, eos_token_id=0,
                       decoder_start_token_id=1)
    MarianMTModel(cfg).save_pretrained(tmp_path / "marian")  # the model only: no tokenizer files
    with pytest.raises(TeacherError, match="no tokenizer"):
        make_teacher(hf_dir=str(tmp_path / "marian"), beam=1).translate(["hello"])


# -- a closed stdout pipe -----------------------------------------------------------------

@pytest.mark.parametrize("command", [["-m", "decoder", "--threads", "1", "--chunk-lines", "4",
                                      "--max-len-a", "0", "--max-len-b", "2", "--quiet"],
                                     ["-m", "submission.container.serve", "--hardware", "CPU-1", "--task", "latency",
                                      "--quiet"]],
                         ids=["decoder", "serve"])
def test_output_piped_into_head_ends_quietly(model_dir, tmp_path, command):
    (tmp_path / "in.txt").write_text("".join(f"the dog sees {i} cats\n" for i in range(400)))
    model = ["--model", model_dir]
    argv = " ".join(shlex.quote(x) for x in [sys.executable, *command, *model])
    r = subprocess.run(["bash", "-c", f'{argv} < in.txt 2> err.txt | head -1; echo "${{PIPESTATUS[0]}}" > rc.txt'],
                       capture_output=True, env=ENV, cwd=tmp_path, timeout=300)
    assert r.stdout.count(b"\n") == 1
    assert (tmp_path / "err.txt").read_text() == ""  # no BrokenPipeError traceback
    assert (tmp_path / "rc.txt").read_text().strip() in ("0", "141")  # 141: as a process killed by SIGPIPE


# -- /run.sh ------------------------------------------------------------------------------

def test_run_sh_refuses_an_extra_argument_and_still_runs_with_two(model_dir):
    run_sh = os.path.join(ROOT, "submission", "container", "run.sh")
    env = dict(ENV, MODEL_DIR=model_dir, PATH=os.path.dirname(sys.executable) + os.pathsep + os.environ["PATH"])
    r = subprocess.run(["sh", run_sh, "CPU-1", "throughput", "extra"], input=b"the dog\n", capture_output=True,
                       env=env, cwd=ROOT, timeout=120)
    err = r.stderr.decode().strip().splitlines()
    assert r.returncode == 2 and r.stdout == b"" and len(err) == 1 and err[0].startswith("usage: /run.sh")
    r = subprocess.run(["sh", run_sh, "CPU-1", "throughput"], input=b"the dog\n\nthe cat\n", capture_output=True,
                       env=env, cwd=ROOT, timeout=300)
    assert r.returncode == 0 and r.stdout.count(b"\n") == 3, r.stderr.decode()[-2000:]


# -- the image build and the Makefile: no shell word splitting ------------------------------

def fake_rootfs(root):
    for d in ("var/cache/apt/archives/partial", "var/lib/apt/lists/partial", "etc"):
        os.makedirs(os.path.join(root, d), exist_ok=True)
    open(os.path.join(root, "var/cache/apt/archives/python3_3.11.deb"), "w").write("deb")
    open(os.path.join(root, "var/lib/apt/lists/deb.debian.org_Packages"), "w").write("list")
    open(os.path.join(root, "etc/os-release"), "w").write("bookworm")
    os.symlink("/etc/os-release", os.path.join(root, "etc/link"))


def test_clean_rootfs_with_a_space_in_the_path_touches_nothing_outside(tmp_path):
    from submission.image import clean_rootfs
    rootfs = tmp_path / "root fs"
    fake_rootfs(rootfs)
    (tmp_path / "root").mkdir()  # what `rm -rf {rootfs}/...` split at the space would delete
    (tmp_path / "root" / "keep").write_text("x")
    clean_rootfs(str(rootfs))
    assert os.listdir(rootfs / "var/cache/apt/archives") == [] and os.listdir(rootfs / "var/lib/apt/lists") == []
    assert (rootfs / "etc/os-release").read_text() == "bookworm"
    assert (tmp_path / "root" / "keep").read_text() == "x"


def test_debootstrap_base_is_imported_with_the_docker_sdk_without_a_shell(tmp_path, monkeypatch):
    from submission import image
    for where in ("ROOT", "HOME"):  # a checkout path with a space (HOME: where build/ is)
        monkeypatch.setattr(image, where, str(tmp_path / "check out"))
    monkeypatch.setattr(image.shutil, "which", lambda name: "/usr/sbin/" + name)
    commands = []

    def run(argv, **kw):
        commands.append(argv)
        if argv[0] == "debootstrap":
            fake_rootfs(argv[-2])
        return subprocess.CompletedProcess(argv, 0)
    monkeypatch.setattr(image.subprocess, "run", run)
    monkeypatch.setattr(image.subprocess, "Popen", lambda *a, **kw: pytest.fail(f"Popen{a}"))
    imported = {}

    class Api:
        def import_image(self, src, repository, tag):
            with tarfile.open(src) as tar:
                imported.update(names=set(tar.getnames()), repo=repository, tag=tag)

    class Client:
        api = Api()
    image.debootstrap_base(Client())
    assert [argv[0] for argv in commands] == ["debootstrap"]  # no sh, tar or docker CLI
    assert (imported["repo"], imported["tag"]) == tuple(image.LOCAL_BASE.split(":"))
    assert {"./etc/os-release", "./etc/link", "./var/cache/apt/archives"} <= imported["names"]
    assert not any(n.endswith(".deb") or n.endswith("_Packages") for n in imported["names"])
    assert os.listdir(tmp_path / "check out" / "build") == []  # rootfs and its tar removed


@pytest.mark.parametrize("target,variables,expected", [
    ("image", {"MODEL": "/tmp/a b/it's", "IMAGE": "kit test:1"},
     [("--model", "/tmp/a b/it's"), ("--tag", "kit test:1")]),
    ("distill", {"SRC": "/tmp/x y.en", "TGT": "/tmp/x y.es", "SRC_LANG": "en;true", "TGT_LANG": "e s"},
     [("--src-lang", "en;true"), ("--tgt-lang", "e s")]),
])
def test_makefile_passes_variables_as_single_arguments(target, variables, expected):
    r = subprocess.run(["make", "-n", target, *(f"{k}={v}" for k, v in variables.items())],
                       capture_output=True, text=True, cwd=ROOT, timeout=60)
    module = "submission.image" if target == "image" else "student.distill"
    line = next(x for x in r.stdout.splitlines() if f"-m {module}" in x)
    argv = shlex.split(line)
    for option, value in expected:
        assert argv[argv.index(option) + 1] == value, line
