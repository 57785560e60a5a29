#!/usr/bin/env python3
"""transformers' long-form Whisper transcription, as references for Tandem's.

    python3 tests/tools/make_longform_reference.py [--model DIR] [--out FILE] [WAV ...]
        The toy model's case (default: tests/data/toy-numbers-whisper, its
        number-42, -4207, -7, -305, -1999 and -18 wavs one after another,
        8.5 s against its 4 s window) -> DIR/longform_reference.json, which
        tests/integration/test_longform.sh compares with the gateway's
        verbose_json.
    python3 tests/tools/make_longform_reference.py --tiny [--model DIR] [--out FILE]
        The random tiny Whisper (default: tests/data/whisper-tiny, a window of
        64 frames) on 300 frames of synthetic features -> DIR/longform_reference.json,
        which test_longform_engine compares with td_longform driving the engine:
        windows that fill their positions, the previous tokens cut to the
        prompt's room, segments ending at a timestamp past the window.

Run from the repository root where torch and transformers are installed (the
GPU machine's image), on the CPU in float32; nothing is downloaded. Each case
is WhisperForConditionalGeneration.generate(features, return_timestamps=True,
return_segments=True, ...) with the settings it records; the settings are
the ones Tandem's tests send:

- temperature 0 alone (no fallback: a sampled window could not be compared),
  compression_ratio_threshold 1.35, logprob_threshold -1.0, no_speech_threshold
  0.6, condition_on_prev_tokens true and false (two cases);
- generation_config.max_length = max_target_positions: each window may fill
  the positions its prompt leaves, as Tandem's windows do;
- generation_config.prev_sot_token_id set where the checkpoint has none
  (<|startofprev|> for the toy, 348 for the tiny one): Tandem puts it before the
  previous windows' tokens, transformers would fall back to the second-to-last
  suppressed token (neither checkpoint lists any) and else put nothing;
- the toy's generation_config.json names no Whisper ids: they come from its
  tokenizer (no_timestamps_token_id, lang_to_id, task_to_id), as Tandem's
  gateway takes them; the tiny one gets no_timestamps_token_id 350 (timestamps
  351..399, <|nospeech|> 349) and no language or task.

The features: the wavs (16 kHz mono 16-bit, read with the standard library's
wave, int16 / 32768) one after another, then WhisperFeatureExtractor(audio,
truncation=False, padding="longest") as long-form generation takes them.
"""
import argparse
import json
import os
import sys
import wave

HERE = os.path.dirname(os.path.abspath(__file__))
DATA = os.path.join(HERE, "..", "data")
TOY = os.path.join(DATA, "toy-numbers-whisper")
TINY = os.path.join(DATA, "whisper-tiny")
TOY_WAVS = ["number-42.wav", "number-4207.wav", "number-7.wav", "number-305.wav", "number-1999.wav",
            "number-18.wav"]
TINY_FRAMES = 300
TINY_NO_TIMESTAMPS = 350
TINY_PREV_SOT = 348

SETTINGS = {"temperature": [0.0], "compression_ratio_threshold": 1.35, "logprob_threshold": -1.0,
            "no_speech_threshold": 0.6}


def read_wavs(paths):
    import numpy as np
    parts = []
    for p in paths:
        w = wave.open(p, "rb")
        if w.getnchannels() != 1 or w.getsampwidth() != 2 or w.getframerate() != 16000:
            sys.exit("%s: 16 kHz mono 16-bit WAV only (%d channels, %d bytes, %d Hz)" %
                     (p, w.getnchannels(), w.getsampwidth(), w.getframerate()))
        parts.append(np.frombuffer(w.readframes(w.getnframes()), dtype="<i2"))
        w.close()
    return (np.concatenate(parts).astype(np.float32) / np.float32(32768.0))


def tiny_features(mels, frames):
    """(((m * 31 + t * 17) % 97) - 48) / 48 in float32: test_longform_engine computes the same."""
    import numpy as np
    m = np.arange(mels, dtype=np.int64)[:, None]
    t = np.arange(frames, dtype=np.int64)[None, :]
    return ((((m * 31 + t * 17) % 97) - 48).astype(np.float32) / np.float32(48.0))[None]


def load_model(d):
    from transformers import WhisperForConditionalGeneration
    # whatever dtype the checkpoint loads in (the toy's is bfloat16), run in float32 as Tandem's CPU backend does
    return WhisperForConditionalGeneration.from_pretrained(d).float().to("cpu").eval()


def load_tokenizer(d):
    import transformers
    err = None
    for name in ("WhisperTokenizerFast", "WhisperTokenizer"):
        cls = getattr(transformers, name, None)
        try:
            if cls is not None:
                return cls.from_pretrained(d)
        except Exception as e:  # the next class, then this error
            err = e
    raise err


def run(model, features, cond, ts_begin, tok_decode):
    import torch
    gc = model.generation_config
    kw = {}
    if getattr(gc, "lang_to_id", None):
        kw = {"language": "en", "task": "transcribe"}
    with torch.no_grad():
        out = model.generate(torch.from_numpy(features), return_timestamps=True, return_segments=True,
                             temperature=tuple(SETTINGS["temperature"]),
                             compression_ratio_threshold=SETTINGS["compression_ratio_threshold"],
                             logprob_threshold=SETTINGS["logprob_threshold"],
                             no_speech_threshold=SETTINGS["no_speech_threshold"],
                             condition_on_prev_tokens=cond, **kw)
    segs, tokens = [], []
    for s in out["segments"][0]:
        t = [int(x) for x in s["tokens"].tolist()]
        tokens += t
        segs.append({"start": float(s["start"]), "end": float(s["end"]), "tokens": t,
                     "text": tok_decode([x for x in t if x < ts_begin]) if tok_decode else None})
    text = tok_decode([x for x in tokens if x < ts_begin]) if tok_decode else None
    case = {"condition_on_prev_tokens": cond, "tokens": tokens, "segments": segs}
    if tok_decode:
        case["text"] = text
    return case


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tiny", action="store_true", help="the random tiny Whisper on synthetic features")
    ap.add_argument("--model", help="the checkpoint folder")
    ap.add_argument("--out", help="the reference file (default: MODEL/longform_reference.json)")
    ap.add_argument("wavs", nargs="*", help="wavs one after another (default: the toy's six)")
    a = ap.parse_args()
    import torch
    import transformers
    torch.manual_seed(0)
    d = a.model or (TINY if a.tiny else TOY)
    model = load_model(d)
    gc = model.generation_config
    gc.max_length = model.config.max_target_positions
    ref = {"transformers": transformers.__version__, "torch": torch.__version__, "settings": dict(SETTINGS),
           "max_length": gc.max_length}
    if a.tiny:
        gc.no_timestamps_token_id = TINY_NO_TIMESTAMPS
        gc.prev_sot_token_id = TINY_PREV_SOT
        features = tiny_features(model.config.num_mel_bins, TINY_FRAMES)
        tok_decode = None
        ref["features"] = "(((m * 31 + t * 17) %% 97) - 48) / 48, float32 [%d, %d]" % tuple(features.shape[1:])
    else:
        from transformers import WhisperFeatureExtractor
        tok = load_tokenizer(d)
        fe = WhisperFeatureExtractor.from_pretrained(d)
        wavs = a.wavs or [os.path.join(d, w) for w in TOY_WAVS]
        audio = read_wavs(wavs)
        features = fe(audio, sampling_rate=16000, truncation=False, padding="longest",
                      return_tensors="np").input_features.astype("float32")
        ids = lambda t: tok.convert_tokens_to_ids(t)
        if getattr(gc, "no_timestamps_token_id", None) is None:
            gc.no_timestamps_token_id = ids("<|notimestamps|>")
        if not getattr(gc, "lang_to_id", None):
            start, stop = ids("<|startoftranscript|>") + 1, ids("<|translate|>")
            gc.lang_to_id = {tok.convert_ids_to_tokens(i): i for i in range(start, stop)}
        if not getattr(gc, "task_to_id", None):
            gc.task_to_id = {"transcribe": ids("<|transcribe|>"), "translate": ids("<|translate|>")}
        gc.is_multilingual = True
        if getattr(gc, "prev_sot_token_id", None) is None:
            gc.prev_sot_token_id = ids("<|startofprev|>")
        tok_decode = lambda t: tok.decode(t, skip_special_tokens=True)
        ref["files"] = [os.path.basename(w) for w in wavs]
        ref["samples"] = int(audio.shape[0])
    ts_begin = gc.no_timestamps_token_id + 1
    ref["total_frames"] = int(features.shape[-1])
    ref["window_frames"] = 2 * model.config.max_source_positions
    ref["timestamp_begin"] = ts_begin
    ref["prev_sot_token_id"] = gc.prev_sot_token_id
    ref["cases"] = [run(model, features, cond, ts_begin, tok_decode) for cond in (True, False)]
    out = a.out or os.path.join(d, "longform_reference.json")
    with open(out, "w") as f:
        json.dump(ref, f, indent=1)
        f.write("\n")
    for c in ref["cases"]:
        print("%s: condition_on_prev_tokens=%s: %d segments, %d tokens%s" %
              (out, c["condition_on_prev_tokens"], len(c["segments"]), len(c["tokens"]),
               (", text %r" % c["text"]) if "text" in c else ""))


if __name__ == "__main__":
    main()
