"""The engines we compare against, on the same weights: CTranslate2 and Hugging Face
transformers (converted by tools/convert/). Each `*_translator` loads once and
returns translate(lines) -> hypotheses with our own text pipeline around it, so
only the search engines differ (submission/evaluate times loading and work apart)."""
from __future__ import annotations

import time

from decoder import modeldir
from decoder.pipeline import Text

from .convert import max_decoding_length, to_hf


def _text(model_dir):
    cfg, _, spm_path = modeldir.load(model_dir)
    return cfg, Text(cfg, spm_path, cfg.arch.max_positions)


def ct2_translator(ct2_dir, model_dir, threads, compute_type, beam=1, max_tokens=4096, batch1=False,
                   device="cpu", inter_threads=1):
    """Load once; return translate(lines) -> hypotheses (submission/evaluate times the two apart).
    threads: intra-op threads of each of the inter_threads workers, which translate the
    sub-batches of one call (max_tokens each) in parallel."""
    import ctranslate2
    cfg, text = _text(model_dir)
    tr = ctranslate2.Translator(ct2_dir, device=device, compute_type=compute_type,
                                intra_threads=threads, inter_threads=inter_threads)
    piece = text.sp.id_to_piece

    def go(ls):
        srcs = text.encode(ls)
        idx = [i for i, s in enumerate(srcs) if s]
        toks = [[piece(t) for t in srcs[i][:-1]] for i in idx]  # the CT2 dir appends </s> (add_source_eos)
        cap = max((max_decoding_length(len(t), cfg.arch.max_positions) for t in toks), default=1)
        kw = dict(beam_size=beam, max_decoding_length=cap,
                  min_decoding_length=0, max_input_length=cfg.arch.max_positions)
        if batch1:
            # one line per call: each gets its own cap, as the decoder gives it
            P = cfg.arch.max_positions
            res = [tr.translate_batch([t], **{**kw, "max_decoding_length": max_decoding_length(len(t), P)})[0]
                   for t in toks]
        else:
            res = tr.translate_batch(toks, max_batch_size=max_tokens, batch_type="tokens", **kw)
        out = [""] * len(ls)
        dec = text.decode([[text.sp.piece_to_id(p) for p in r.hypotheses[0]] for r in res])
        for i, s in zip(idx, dec):
            out[i] = s
        return out
    return go


def run_ct2(ct2_dir, model_dir, lines, threads, compute_type, beam=1, max_tokens=4096, batch1=False):
    go = ct2_translator(ct2_dir, model_dir, threads, compute_type, beam, max_tokens, batch1)
    go(lines[:8])
    t = time.perf_counter()
    out = go(lines)
    return out, time.perf_counter() - t


def hf_translator(model_dir, threads, batch=64, beam=1):
    """Load once; return translate(lines) -> hypotheses."""
    import torch
    torch.set_num_threads(threads)
    model, cfg = to_hf(model_dir)
    _, text = _text(model_dir)

    def go(ls):
        srcs = text.encode(ls)
        idx = sorted((i for i, s in enumerate(srcs) if s), key=lambda i: -len(srcs[i]))
        out = [""] * len(ls)
        for b in range(0, len(idx), batch):
            chunk = idx[b:b + batch]
            S = max(len(srcs[i]) for i in chunk)
            ids = torch.full((len(chunk), S), cfg.pad_id)
            for r, i in enumerate(chunk):
                ids[r, :len(srcs[i])] = torch.tensor(srcs[i])
            with torch.inference_mode():
                g = model.generate(ids, attention_mask=ids != cfg.pad_id, num_beams=beam, do_sample=False,
                                   max_new_tokens=min(int(S * 1.5 + 10), cfg.arch.max_positions - 1),
                                   min_length=0, decoder_start_token_id=cfg.decoder_start_id,
                                   eos_token_id=cfg.eos_id, pad_token_id=cfg.pad_id)
            hyps = []
            for row in g[:, 1:].tolist():
                row = row[:row.index(cfg.eos_id)] if cfg.eos_id in row else row
                hyps.append([t for t in row if t != cfg.pad_id])
            for i, s in zip(chunk, text.decode(hyps)):
                out[i] = s
        return out
    return go


def run_hf(model_dir, lines, threads, batch=64):
    go = hf_translator(model_dir, threads, batch)
    go(lines[:8])
    t = time.perf_counter()
    out = go(lines)
    return out, time.perf_counter() - t
