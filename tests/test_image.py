"""submission/image.py: the OCI labels of the image, and a rebuild that leaves no
dangling image behind (the slow test builds for real with the docker SDK)."""
import contextlib
import hashlib
import os
import re
import subprocess
from datetime import datetime, timedelta, timezone

import pytest

from fixture_model import make_model_dir

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BIBLE_TINY = os.path.join(ROOT, "tests", "fixtures", "bible-tiny", "model")


def test_revision_label_is_the_git_commit_and_unknown_outside_git(tmp_path):
    from submission.image import git_revision
    head = subprocess.run(["git", "-C", ROOT, "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip()
    assert git_revision(ROOT) == head and len(head) == 40
    assert git_revision(str(tmp_path)) == "unknown"


def test_source_label_is_the_remote_else_pyprojects_url_else_unknown(tmp_path):
    from submission.image import source_url
    assert source_url(str(tmp_path)) == "unknown"
    (tmp_path / "pyproject.toml").write_text('[project]\nname = "x"\n[project.urls]\n'
                                             'Source = "https://example.org/wmt-kit"\n')
    assert source_url(str(tmp_path)) == "https://example.org/wmt-kit"
    subprocess.run(["git", "init", "-q", str(tmp_path)], check=True)
    subprocess.run(["git", "-C", str(tmp_path), "remote", "add", "origin", "https://git.example/kit.git"], check=True)
    assert source_url(str(tmp_path)) == "https://git.example/kit.git"


def test_labels_carry_the_model_hash_and_the_creation_time(tmp_path):
    from submission.image import MODEL_FILES, oci_labels
    labels = oci_labels(BIBLE_TINY)
    h = hashlib.sha256()
    for f in MODEL_FILES:
        h.update(f.encode() + b"\0" + open(os.path.join(BIBLE_TINY, f), "rb").read())
    assert labels["org.wmt-kit.model.sha256"] == h.hexdigest()
    created = datetime.fromisoformat(labels["org.opencontainers.image.created"])
    assert abs(datetime.now(timezone.utc) - created) < timedelta(minutes=1)
    assert {"org.opencontainers.image.source", "org.opencontainers.image.revision"} <= set(labels)
    other = make_model_dir(tmp_path / "m", vocab_size=300, d_model=32, enc=1, dec=1)
    assert oci_labels(str(other))["org.wmt-kit.model.sha256"] != h.hexdigest()


@pytest.mark.slow
def test_rebuilding_a_tag_leaves_no_dangling_image_and_labels_it(tmp_path):
    from test_container import docker_or_skip
    c = docker_or_skip()
    import docker

    from submission.image import build, model_hash
    tag = f"wmt-kit-test-rebuild:{os.getpid()}"
    one = str(make_model_dir(tmp_path / "one", vocab_size=300, d_model=32, enc=1, dec=1, seed=1))
    other = str(make_model_dir(tmp_path / "m", vocab_size=300, d_model=32, enc=1, dec=1))
    second_key = None
    with key_tags_kept(c) as kept:
        try:
            first = c.images.get(build(one, tag=tag, quiet=True)).id
            second_key = build(other, tag=tag, quiet=True)
            second = c.images.get(second_key)
            assert second.id != first and tag in second.tags
            with pytest.raises(docker.errors.ImageNotFound):  # the image the tag left: gone, not dangling
                c.images.get(first)
            dangling = {im.id for im in c.images.list(filters={"dangling": True})}
            stages = [im for im in c.images.list(name="wmt-kit-build")]
            assert len(stages) == 1 and stages[0].id not in dangling  # the build stage is kept as a tagged cache
            labels = second.labels
            assert labels["org.wmt-kit.model.sha256"] == model_hash(other)
            head = subprocess.run(["git", "-C", ROOT, "rev-parse", "HEAD"], capture_output=True,
                                  text=True).stdout.strip()
            assert labels["org.opencontainers.image.revision"] == head
            assert labels["org.opencontainers.image.source"] and labels["org.opencontainers.image.created"]
        finally:
            for t in (tag, second_key):  # a random model's image: of no use to another test
                if t:
                    c.images.remove(t)
    assert all(c.images.get(t) for t in kept)  # the other tests' images, as they were


@contextlib.contextmanager
def key_tags_kept(c):
    """The images other tests built keep their key tags: a build of another model prunes them
    (prune_old_keys), so they are held under a tag of this test meanwhile and tagged again after
    it. Without it the next module's image fixture rebuilt its image (half a minute here)."""
    from submission.image import repo
    held = [(t, im) for im in c.images.list(name=repo()) for t in im.tags
            if re.fullmatch(rf"{repo()}:[0-9a-f]{{16}}", t)]
    hold = [("wmt-kit-test-hold", f"{os.getpid()}-{i}") for i in range(len(held))]
    for (_, im), h in zip(held, hold):
        im.tag(*h)
    try:
        yield [t for t, _ in held]
    finally:
        for (t, im), h in zip(held, hold):
            im.tag(*t.split(":"))
            c.images.remove(":".join(h))
