"""decoder/normalise.py: sacremoses' Moses normalisation with rules skipped where they
cannot match gives sacremoses' output, for every option and language the kit passes."""
import itertools
import os
import re

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from sacremoses import MosesPunctNormalizer

from decoder import modeldir
from decoder.normalise import MosesPunct, moses_punct, required, trigger
from decoder.pipeline import Text

HERE = os.path.dirname(__file__)
OPTIONS = ("penn", "norm_quote_commas", "norm_numbers", "pre_replace_unicode_punct", "post_remove_control_chars")
LANGS = ("en", "es", "de", "fr", "cs", "it")


def every_rule(n: MosesPunctNormalizer) -> list[tuple[str, str]]:
    return list(n.REPLACE_UNICODE_PUNCTUATION) + list(n.substitutions)


def rule_characters() -> str:
    """Every character any rule's pattern or replacement names."""
    n = MosesPunctNormalizer(lang="en", perl_parity=True, **{o: True for o in OPTIONS})
    chars = {c for p, r in every_rule(n) for c in p + r}
    return "".join(sorted(chars))


# what the rules look for, the letters and digits their groups take, spaces of every kind,
# controls (post_remove_control_chars) and any other character
ALPHABET = st.sampled_from(rule_characters() + "aZ09 \xa0\t\x00\x1f\x7f\x85\u200b\u2028\ue000\U000e0001º")
texts = st.one_of(st.text(ALPHABET, max_size=40), st.text(max_size=20),
                  st.lists(st.one_of(st.text(ALPHABET, max_size=6), st.text(max_size=3)), max_size=8).map("".join))


@settings(max_examples=300, deadline=None)
@given(text=texts, lang=st.sampled_from(LANGS), flags=st.lists(st.booleans(), min_size=6, max_size=6))
def test_fast_normaliser_gives_sacremoses_output(text, lang, flags):
    kw = dict(zip(OPTIONS + ("perl_parity",), flags))
    plain = MosesPunctNormalizer(lang=lang, **kw)
    assert MosesPunct(plain)(text) == plain.normalize(text)


SHARED: dict = {}  # one fast normaliser per language across examples: its rules kept per character set


@settings(max_examples=300, deadline=None)
@given(lines=st.lists(texts, min_size=1, max_size=6), lang=st.sampled_from(LANGS))
def test_one_normaliser_gives_sacremoses_output_line_after_line(lines, lang):
    plain = MosesPunctNormalizer(lang=lang, **{o: True for o in OPTIONS})
    fast = SHARED.setdefault(lang, MosesPunct(plain))
    assert fast.by_chars is not None  # the rules looked for depend on the line's non-ASCII characters
    assert [fast(t) for t in lines] == [plain.normalize(t) for t in lines]


def test_a_replacement_that_brings_a_new_non_ascii_character_makes_every_line_look_for_every_rule():
    n = MosesPunctNormalizer(lang="en")
    n.substitutions = [("x", "„")] + list(n.substitutions)  # a later rule looks for „
    fast = MosesPunct(n)
    assert fast.by_chars is None and fast("a x") == n.normalize("a x") == 'a "'


@settings(max_examples=300, deadline=None)
@given(text=texts)
def test_a_rule_without_its_trigger_in_the_line_leaves_it_unchanged(text):
    n = MosesPunctNormalizer(lang="en", perl_parity=True, **{o: True for o in OPTIONS})
    for p, r in every_rule(n):
        need = trigger(p, r)
        if need is not None and need not in text:
            assert re.sub(p, r, text) == text, (p, r)


def test_required_finds_the_literal_every_match_contains():
    assert required(r"\(") == "("
    assert required(r"(\d) %") == " %"
    assert required(r"\) ([.!:?;,])") == ") "
    assert required("([a-zA-Z])’([a-zA-Z])") == "’"
    assert required(r'(\.+)"(\s*[^<])') in ('.', '"')  # both are in every match
    assert required("\xa0ºC") == "\xa0ºC"
    assert required("(?:ab)+c") == "ab"


def test_required_gives_up_where_a_literal_is_not_certain():
    assert required(r"\d+") is None          # no literal at all
    assert required("a*b?") is None          # optional literals
    assert required("x|y") is None           # alternatives
    assert required("(?i)abc") is None       # case folding: 'ABC' matches too
    assert required("(unclosed") is None     # not a pattern: the rule just runs


def test_squeezing_spaces_needs_two_spaces():
    assert trigger(" +", " ") == "  "
    assert trigger(" +", "") == " "


def test_fast_normaliser_matches_on_the_corpus_lines():
    lines = []
    for side, lang in (("en", "en"), ("es", "es")):
        with open(os.path.join(HERE, "fixtures", "bible-tiny", f"test.{side}"), encoding="utf-8") as fh:
            lines += [(line.rstrip("\n"), lang) for line in fh]
    lines += [("«Hola»  ¿qué tal? 1\xa0000 ％ “x” ’tis…\x07", "es"), ("He said ``hi''  ( ok ) :", "en")]
    for (text, lang), kw in itertools.product(lines, ({}, {o: True for o in OPTIONS})):
        assert moses_punct(lang, **kw)(text) == MosesPunctNormalizer(lang=lang, **kw).normalize(text)


def test_switch_fast_normaliser_picks_the_text_normaliser(tmp_path):
    cfg, _, spm_path = modeldir.load(os.path.join(HERE, "fixtures", "bible-tiny", "model"))
    if not cfg.normaliser:
        pytest.skip("the fixture model has no normaliser")
    fast, plain = Text(cfg, spm_path, 64), Text(cfg, spm_path, 64, fast_normaliser=False)
    assert isinstance(fast.normalise, MosesPunct)
    assert getattr(plain.normalise, "__self__", None).__class__ is MosesPunctNormalizer
    line = "“Hello”  ( world ) …"
    assert fast.encode([line]) == plain.encode([line])


# -- normalise_processes: the normaliser in worker processes ------------------------------------

def test_normalise_processes_take_half_the_cores_and_leave_small_machines_alone():
    from decoder.pipeline import normalise_processes
    assert [normalise_processes(c) for c in (1, 2, 3, 4, 6, 16, 64)] == [0, 0, 0, 2, 3, 8, 8]


def test_normaliser_processes_give_this_process_ids_in_order(monkeypatch):
    from decoder import pipeline
    from decoder.pipeline import POOL_LINES, NormalisePool
    monkeypatch.setattr(pipeline, "_POOLS", {})  # this test's shared pool, closed at its end
    cfg, _, spm_path = modeldir.load(os.path.join(HERE, "fixtures", "bible-tiny", "model"))
    if not cfg.normaliser:
        pytest.skip("the fixture model has no normaliser")
    with open(os.path.join(HERE, "fixtures", "bible-tiny", "test.en"), encoding="utf-8") as fh:
        lines = [line.rstrip("\n") for line in fh][:POOL_LINES] * 2
    lines[7], lines[300] = "“Hello”  ( world ) …\x07", ""
    here, pooled = Text(cfg, spm_path, 64), Text(cfg, spm_path, 64)
    norm = cfg.normaliser
    pooled.pool = NormalisePool(norm.get("src_lang", cfg.src_lang), modeldir.moses_options(norm), 2)
    try:
        assert pooled.pool.pool.n == 2 and len(pooled.pool.pool.pids()) == 2
        assert pooled.encode(lines) == here.encode(lines)
        assert pooled.encode(lines[:POOL_LINES - 1]) == here.encode(lines[:POOL_LINES - 1])  # below: here
    finally:
        pooled.pool.close()
    assert NormalisePool.shared(cfg, 2) is NormalisePool.shared(cfg, 2)  # one a process and normaliser
    NormalisePool.shared(cfg, 2).close()


def test_normalise_processes_resolve_on_cuda_with_the_fast_normaliser_only():
    from decoder.optimisations import Kernels, Switches, resolve
    both = Kernels(cpu=True, cuda=True)
    assert resolve(Switches(), device="cuda", kernels=both).normalise_processes
    assert not resolve(Switches(fast_normaliser=False), device="cuda", kernels=both).normalise_processes
    assert not resolve(Switches(), device="cpu", kernels=both).normalise_processes
