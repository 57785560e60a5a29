#!/usr/bin/env python3
"""Build extra reference checkpoints with Hugging Face transformers.

Each model is randomly initialised the way ../shared/fixtures was (2-D+
weights N(0,1)/sqrt(fan_in), embeddings and T5 bias tables N(0,1), norm
weights 1+0.1N, other 1-D parameters and final_logits_bias 0.1N, fixed
sinusoidal tables left as built), saved with save_pretrained, and its float32
CPU outputs are written in the fixture layout (reference.json,
ref_encoder_out.f32, ref_logits.f32, beam_reference.json).

    python3 make_fixtures.py OUTDIR [name ...]

Run where torch and transformers exist (the GPU machine's image).
"""
import json
import os
import sys
import traceback

import torch
import transformers as tf


def reinit(model, seed):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if not p.requires_grad:
                continue  # fixed sinusoidal tables
            if p.dim() >= 2:
                if "embed" in name or "shared" in name or "relative_attention_bias" in name:
                    p.copy_(torch.randn(p.shape, generator=g))
                else:
                    fan_in = p[0].numel()
                    p.copy_(torch.randn(p.shape, generator=g) / fan_in ** 0.5)
            elif "norm" in name and name.endswith("weight"):
                p.copy_(1 + 0.1 * torch.randn(p.shape, generator=g))
            else:
                p.copy_(0.1 * torch.randn(p.shape, generator=g))
        for name, b in model.named_buffers():
            if name.endswith("final_logits_bias"):
                b.copy_(0.1 * torch.randn(b.shape, generator=g))


def make_requests(cfg, n, seed, kind, special):
    g = torch.Generator().manual_seed(seed + 1)
    reqs = []
    enc_lens = [5, 17, 2, 33, 1, 26, 9][:n]
    dec_lens = [1, 4, 9, 2, 6, 3, 7][:n]
    vocab = cfg.vocab_size
    for i in range(n):
        r = {}
        if kind != "whisper":
            L = enc_lens[i]
            ids = torch.randint(3, vocab, (L,), generator=g).tolist()
            ids[-1] = special["eos"]
            if kind in ("bart", "mbart") and L > 2:
                ids[0] = special.get("bos", ids[0])
            r["input_ids"] = ids
            r["encoder_len"] = L
        else:
            r["encoder_len"] = cfg.max_source_positions
        p = torch.randint(3, vocab, (dec_lens[i],), generator=g).tolist()
        p[0] = special["start"]
        r["decoder_prompt"] = p
        reqs.append(r)
    return reqs


def encoder_inputs(kind, r, feats):
    if kind == "whisper":
        return {"input_features": feats}
    return {"input_ids": torch.tensor([r["input_ids"]])}


def build(outdir, name, kind, model, gen_overrides, special, n_req, max_new, seed,
          save_dtype=None, shard=None, beam=True):
    d = os.path.join(outdir, name)
    os.makedirs(d, exist_ok=True)
    reinit(model, seed)
    model.eval()
    for k, v in gen_overrides.items():
        setattr(model.generation_config, k, v)
    if save_dtype is not None:
        model = model.to(save_dtype)
    kw = {"safe_serialization": True}
    if shard:
        kw["max_shard_size"] = shard
    model.save_pretrained(d, **kw)
    model = model.float()  # the reference runs on the rounded weights
    cfg = model.config
    reqs = make_requests(cfg, n_req, seed, kind, special)
    feats_all = None
    if kind == "whisper":
        g = torch.Generator().manual_seed(seed + 2)
        feats_all = torch.randn(n_req, cfg.num_mel_bins, 2 * cfg.max_source_positions, generator=g)
        feats_all.numpy().astype("<f4").tofile(os.path.join(d, "input_features.f32"))
    enc_chunks, logit_chunks = [], []
    eos = special["eos"]
    with torch.no_grad():
        for i, r in enumerate(reqs):
            feats = feats_all[i:i + 1] if feats_all is not None else None
            enc = model.get_encoder()(**encoder_inputs(kind, r, feats))
            enc_chunks.append(enc.last_hidden_state[0])
            dec = list(r["decoder_prompt"])
            out = []
            for _ in range(max_new):
                lg = model(encoder_outputs=enc, decoder_input_ids=torch.tensor([dec])).logits[0, -1]
                t = int(lg.argmax())
                out.append(t)
                dec.append(t)
                if t == eos:
                    break
            r["greedy_tokens"] = out
            full = r["decoder_prompt"] + out[:-1]
            lg = model(encoder_outputs=enc, decoder_input_ids=torch.tensor([full])).logits[0]
            logit_chunks.append(lg)
    torch.cat(enc_chunks).numpy().astype("<f4").tofile(os.path.join(d, "ref_encoder_out.f32"))
    torch.cat(logit_chunks).numpy().astype("<f4").tofile(os.path.join(d, "ref_logits.f32"))
    ref = {"model": name, "transformers_version": tf.__version__,
           "decoder_start_token_id": special["start"], "eos_token_id": eos,
           "max_new_tokens": max_new, "requests": reqs}
    with open(os.path.join(d, "reference.json"), "w") as f:
        json.dump(ref, f, indent=1)
    if beam and kind != "whisper":
        breqs = []
        with torch.no_grad():
            for r in reqs:
                o = model.generate(input_ids=torch.tensor([r["input_ids"]]),
                                   decoder_input_ids=torch.tensor([r["decoder_prompt"]]),
                                   num_beams=4, num_return_sequences=4, length_penalty=1.0,
                                   early_stopping=True, max_new_tokens=10,
                                   output_scores=True, return_dict_in_generate=True)
                seqs = []
                P = len(r["decoder_prompt"])
                for s in o.sequences.tolist():
                    s = s[P:]
                    # Only what follows EOS is padding: a pad-valued token
                    # before it (T5 starts with pad) is a real token.
                    if eos in s:
                        s = s[:s.index(eos) + 1]
                    seqs.append(s)
                breqs.append({"sequences": seqs, "scores": o.sequences_scores.tolist()})
        note = ("transformers generate() with num_beams=4, num_return_sequences=4, "
                "length_penalty=1.0, early_stopping=True, max_new_tokens=10 on the model's "
                "generation_config.json, float32 on the CPU, decoder_input_ids = the request "
                "decoder_prompt; sequences exclude the prompt and end at EOS; scores are "
                "sequences_scores, best first.")
        with open(os.path.join(d, "beam_reference.json"), "w") as f:
            json.dump({"num_beams": 4, "num_return_sequences": 4, "length_penalty": 1.0,
                       "early_stopping": True, "max_new_tokens": 10, "note": note,
                       "requests": breqs}, f, indent=1)
    print("built", name, "requests", len(reqs), flush=True)


def t5v11_gated(out):
    cfg = tf.T5Config(vocab_size=257, d_model=48, d_kv=12, d_ff=72, num_layers=3,
                      num_decoder_layers=2, num_heads=6, relative_attention_num_buckets=16,
                      relative_attention_max_distance=20, feed_forward_proj="gated-gelu",
                      tie_word_embeddings=False, decoder_start_token_id=0, eos_token_id=1,
                      pad_token_id=0, dropout_rate=0.0)
    build(out, "t5v11-gated-untied", "t5", tf.T5ForConditionalGeneration(cfg), {},
          {"start": 0, "eos": 1}, 6, 12, 11, save_dtype=torch.bfloat16)


def t5_gated_untied_head(out):
    # transformers 5.17's T5Config turns tie_word_embeddings back on; untie
    # after construction so that lm_head is its own tensor in the file.
    cfg = tf.T5Config(vocab_size=211, d_model=32, d_kv=8, d_ff=40, num_layers=2,
                      num_decoder_layers=2, num_heads=4, relative_attention_num_buckets=8,
                      relative_attention_max_distance=16, feed_forward_proj="gated-gelu",
                      decoder_start_token_id=0, eos_token_id=1, pad_token_id=0, dropout_rate=0.0)
    model = tf.T5ForConditionalGeneration(cfg)
    model.config.tie_word_embeddings = False
    model.config.scale_decoder_outputs = False
    model.lm_head = torch.nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
    keys = getattr(model, "_tied_weights_keys", None)
    if isinstance(keys, dict):
        model._tied_weights_keys = {k: v for k, v in keys.items() if "lm_head" not in k}
    elif keys:
        model._tied_weights_keys = [k for k in keys if "lm_head" not in k]
    build(out, "t5-gated-untied-head", "t5", model, {}, {"start": 0, "eos": 1}, 4, 10, 17)


def mt5_silu(out):
    cfg = tf.MT5Config(vocab_size=301, d_model=40, d_kv=10, d_ff=56, num_layers=2,
                       num_decoder_layers=3, num_heads=3, relative_attention_num_buckets=24,
                       relative_attention_max_distance=64, feed_forward_proj="gated-silu",
                       tie_word_embeddings=True, decoder_start_token_id=0, eos_token_id=1,
                       pad_token_id=0, dropout_rate=0.0)
    build(out, "mt5-silu-tied", "t5", tf.MT5ForConditionalGeneration(cfg), {},
          {"start": 0, "eos": 1}, 5, 12, 12, save_dtype=torch.float16)


def mbart_prenorm(out):
    cfg = tf.MBartConfig(vocab_size=311, d_model=64, encoder_layers=2, decoder_layers=3,
                         encoder_attention_heads=4, decoder_attention_heads=8,
                         encoder_ffn_dim=96, decoder_ffn_dim=80, activation_function="relu",
                         scale_embedding=True, max_position_embeddings=80, pad_token_id=1,
                         bos_token_id=0, eos_token_id=2, decoder_start_token_id=2,
                         forced_eos_token_id=2, dropout=0.0, attention_dropout=0.0,
                         activation_dropout=0.0)
    build(out, "mbart-prenorm-sharded", "mbart", tf.MBartForConditionalGeneration(cfg),
          {"forced_eos_token_id": 2}, {"start": 2, "eos": 2, "bos": 0}, 6, 12, 13,
          shard="100KB")


def marian_sinus(out):
    cfg = tf.MarianConfig(vocab_size=280, decoder_vocab_size=280, d_model=48, encoder_layers=2,
                          decoder_layers=2, encoder_attention_heads=4,
                          decoder_attention_heads=4, encoder_ffn_dim=96, decoder_ffn_dim=96,
                          activation_function="swish", scale_embedding=True,
                          max_position_embeddings=128, pad_token_id=279, eos_token_id=0,
                          decoder_start_token_id=279, forced_eos_token_id=0, dropout=0.0,
                          attention_dropout=0.0, activation_dropout=0.0)
    build(out, "marian-sinusoidal", "marian", tf.MarianMTModel(cfg),
          {"forced_eos_token_id": 0, "max_length": 64}, {"start": 279, "eos": 0}, 6, 12, 14)


def bart_untied(out):
    cfg = tf.BartConfig(vocab_size=290, d_model=32, encoder_layers=1, decoder_layers=3,
                        encoder_attention_heads=2, decoder_attention_heads=2,
                        encoder_ffn_dim=64, decoder_ffn_dim=48, activation_function="gelu_new",
                        scale_embedding=True, max_position_embeddings=72, pad_token_id=1,
                        bos_token_id=0, eos_token_id=2, decoder_start_token_id=2,
                        forced_eos_token_id=2, tie_word_embeddings=False, dropout=0.0,
                        attention_dropout=0.0, activation_dropout=0.0)
    build(out, "bart-untied-gelunew", "bart", tf.BartForConditionalGeneration(cfg),
          {"forced_eos_token_id": 2}, {"start": 2, "eos": 2, "bos": 0}, 5, 12, 15)


def whisper_128(out):
    cfg = tf.WhisperConfig(vocab_size=333, num_mel_bins=128, d_model=96, encoder_layers=3,
                           decoder_layers=2, encoder_attention_heads=2,
                           decoder_attention_heads=6, encoder_ffn_dim=128, decoder_ffn_dim=160,
                           max_source_positions=24, max_target_positions=40, pad_token_id=2,
                           bos_token_id=1, eos_token_id=2, decoder_start_token_id=1,
                           begin_suppress_tokens=None, suppress_tokens=None, dropout=0.0,
                           attention_dropout=0.0, activation_dropout=0.0)
    build(out, "whisper-128mel", "whisper", tf.WhisperForConditionalGeneration(cfg), {},
          {"start": 1, "eos": 2}, 3, 10, 16, beam=False)


def t5_four_layers(out):
    # four decoder layers and four heads: PP=4 and TP=4 groups
    cfg = tf.T5Config(vocab_size=263, d_model=64, d_kv=16, d_ff=96, num_layers=4,
                      num_decoder_layers=4, num_heads=4, relative_attention_num_buckets=16,
                      relative_attention_max_distance=32, feed_forward_proj="gated-gelu",
                      tie_word_embeddings=False, decoder_start_token_id=0, eos_token_id=1,
                      pad_token_id=0, dropout_rate=0.0)
    build(out, "t5-four-layers", "t5", tf.T5ForConditionalGeneration(cfg), {},
          {"start": 0, "eos": 1}, 6, 12, 18, save_dtype=torch.bfloat16)


def whisper_four_layers(out):
    cfg = tf.WhisperConfig(vocab_size=347, num_mel_bins=80, d_model=64, encoder_layers=4,
                           decoder_layers=4, encoder_attention_heads=4,
                           decoder_attention_heads=4, encoder_ffn_dim=128, decoder_ffn_dim=128,
                           max_source_positions=24, max_target_positions=40, pad_token_id=2,
                           bos_token_id=1, eos_token_id=2, decoder_start_token_id=1,
                           begin_suppress_tokens=None, suppress_tokens=None, dropout=0.0,
                           attention_dropout=0.0, activation_dropout=0.0)
    build(out, "whisper-four-layers", "whisper", tf.WhisperForConditionalGeneration(cfg), {},
          {"start": 1, "eos": 2}, 3, 10, 19, beam=False)


BUILDERS = {"t5-gated-untied-head": t5_gated_untied_head, "t5v11-gated-untied": t5v11_gated, "mt5-silu-tied": mt5_silu,
            "mbart-prenorm-sharded": mbart_prenorm, "marian-sinusoidal": marian_sinus,
            "bart-untied-gelunew": bart_untied, "whisper-128mel": whisper_128,
            "t5-four-layers": t5_four_layers, "whisper-four-layers": whisper_four_layers}


def main():
    out = sys.argv[1]
    names = sys.argv[2:] or list(BUILDERS)
    torch.manual_seed(0)
    failed = 0
    for n in names:
        try:
            BUILDERS[n](out)
        except Exception:
            failed += 1
            print("FAILED", n, flush=True)
            traceback.print_exc()
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
