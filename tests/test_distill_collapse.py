"""A stage whose output collapsed stops student.distill with one line naming the cause and the way
out, a non-zero exit, and the stages done kept for the rerun. Before: a teacher that had not
learned (dev BLEU 0.47) went on to distil, cleaning removed 7,999 of its 8,000 translations as
repetitive, and the student trained for 3 minutes on the one pair left; only the final report
said "failed to learn"."""
import json
import sys
import textwrap

from test_distill import distill, env, manifest  # noqa: F401  (env is a fixture)

# a teacher that loops on every line but the first ("la la la la la la": repetitive)
LOOPING = textwrap.dedent("""
    import sys
    lines = sys.stdin.read().split("\\n")[:-1]
    sys.stdout.write("".join((x.upper() if i == 0 else "la la la la la la") + "\\n" for i, x in enumerate(lines)))
""")


def error_lines(r) -> list[str]:
    assert "Traceback" not in r.stderr, r.stderr[-3000:]
    return [x for x in r.stderr.splitlines() if x.startswith("error:")]


def test_a_teacher_below_the_dev_bleu_floor_stops_before_distilling_and_the_rerun_reuses_its_stages(env):  # noqa: F811
    common = ["--teacher-steps", "3", "--student-steps", "2", "--shard-size", "100"]
    r = distill(env, "weak", *common, check=False)
    err = error_lines(r)
    assert r.returncode == 2 and len(err) == 1, r.stderr[-3000:]
    assert err[0].startswith("error: the teacher's dev BLEU is 0.00, below --min-teacher-bleu 1: it did not learn "
                             "in 3 steps") and "--teacher-minutes" in err[0], err
    m = manifest(env, "weak")
    assert set(m["stages"]) == {"data", "teacher"}  # nothing distilled, no student trained
    r = distill(env, "weak", *common, check=False)
    assert r.returncode == 2 and r.stderr.count("up to date") == 2, r.stderr[-3000:]
    assert {k: v["status"] for k, v in manifest(env, "weak")["stages"].items()} == {"data": "reused",
                                                                                  "teacher": "reused"}


def test_a_corpus_that_cleaning_collapses_stops_naming_the_way_out_and_mix_original_goes_on(env):  # noqa: F811
    (env / "looping.py").write_text(LOOPING, encoding="utf-8")
    common = ["--teacher-cmd", f"{sys.executable} {env / 'looping.py'}", "--student-steps", "2",
              "--shortlist-k", "0", "--test-limit", "3"]
    r = distill(env, "loop", *common, check=False)
    err = error_lines(r)
    n = json.load(open(env / "runs" / "loop" / "manifest.json"))["stages"]["distill"]["result"]["sentences"]
    assert r.returncode == 2 and len(err) == 1, r.stderr[-3000:]
    assert err[0].startswith(f"error: cleaning kept 1 of the teacher's {n:,} translations (removed {n - 1:,} "
                             f"repetitive), below --min-kept 0.5: ") and "--mix-original" in err[0], err
    m = manifest(env, "loop")
    assert set(m["stages"]) == {"data", "distill", "corpus"} and "student" not in m["stages"]
    r = distill(env, "loop", *common, "--mix-original")  # the way out: the original pairs too
    st = {k: v["status"] for k, v in manifest(env, "loop")["stages"].items()}
    assert st["data"] == st["distill"] == "reused" and st["corpus"] == st["student"] == "ran", st
