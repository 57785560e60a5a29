#!/usr/bin/env python3
"""Whisper audio cases with the features transformers computes for them.

    python3 tests/tools/make_audio_fixtures.py [OUTDIR]
        OUTDIR defaults to tests/data/audio/generated; run from the repository
        root where numpy, torch, torchaudio and transformers are installed
        (the GPU machine's image). soundfile (pip's, with its libsndfile) adds
        the FLAC and OGG cases; without it they are left out and said so.
    python3 tests/tools/make_audio_fixtures.py --stand-in OUTDIR
        the same files with numpy stand-ins for transformers and torchaudio
        (restated below), to check this script and the C test's plumbing
        where transformers is missing: never commit its output.
    python3 tests/tools/make_audio_fixtures.py filters NPZ OUTDIR
        openai/whisper's mel_filters.npz -> OUTDIR/mel_filters_{80,128}.f32
        (float32 [mels, 201], row-major; the standard library only).

Each case is an audio file (WAV PCM 16, FLAC or OGG Vorbis; 8, 16, 22.05,
44.1 or 48 kHz; mono or stereo; 3 s to a minute) and its features, float32
[mels, frames] a window, the windows one after another (mode "windows":
WhisperFeatureExtractor on each chunk_length slice, as `tandem-frontend mel`
writes them) or the whole audio at once (mode "whole": truncation=False,
padding="longest", as long-form generation takes it). manifest.json lists
them. The reference path is transformers' ASR pipeline given an array and its
rate: the file read back (wave for WAV, soundfile for FLAC / OGG: the very
samples a decoder gets, the codec's loss included), channels averaged,
torchaudio.functional.resample(x, rate, 16000) at its defaults (what the
pipeline calls: sinc_interp_hann, lowpass_filter_width 6, rolloff 0.99), then
WhisperFeatureExtractor(feature_size=mels, chunk_length=chunk).
"""
import ast
import json
import math
import os
import sys
import wave
import zipfile

RATE = 16000
HERE = os.path.dirname(os.path.abspath(__file__))
DATA = os.path.join(HERE, "..", "data")
SPEECH = os.path.join(DATA, "frontend", "speech.wav")
NUMBERS = os.path.join(DATA, "audio", "toy-numbers-whisper")


def filters_from_npz(npz, outdir):
    os.makedirs(outdir, exist_ok=True)
    z = zipfile.ZipFile(npz)
    for name in z.namelist():
        d = z.read(name)
        assert d[:6] == b"\x93NUMPY", name
        hl = int.from_bytes(d[8:10], "little")
        h = ast.literal_eval(d[10:10 + hl].decode("latin1"))
        assert h["descr"] == "<f4" and not h["fortran_order"], h
        rows, cols = h["shape"]
        body = d[10 + hl:]
        assert len(body) == 4 * rows * cols
        out = os.path.join(outdir, "mel_filters_%d.f32" % rows)
        open(out, "wb").write(body)
        print("%s: [%d, %d] from %s" % (out, rows, cols, name))


# ---- the reference (transformers, torchaudio) or its numpy stand-in ----

class Reference:
    def __init__(self, stand_in):
        import numpy as np
        self.np = np
        self.stand_in = stand_in
        if stand_in:
            self.made_with = {"stand_in": "numpy restatements of WhisperFeatureExtractor's numpy path and "
                                          "torchaudio's resample; not transformers", "numpy": np.__version__}
            self.feature_path = "numpy stand-in"
            return
        import torch
        import torchaudio
        import transformers
        from torchaudio import functional as F
        from transformers import WhisperFeatureExtractor
        self.torch, self.F, self.FE = torch, F, WhisperFeatureExtractor
        self.made_with = {"transformers": transformers.__version__, "torch": torch.__version__,
                          "torchaudio": torchaudio.__version__, "numpy": np.__version__}
        self.feature_path = "torch" if transformers.is_torch_available() else "numpy"

    def resample(self, x, rate, to=RATE):
        np = self.np
        x = np.ascontiguousarray(x, dtype=np.float32)
        if rate == to:
            return x
        if not self.stand_in:
            return self.F.resample(self.torch.from_numpy(x), rate, to).numpy()
        g = math.gcd(rate, to)
        orig, new = rate // g, to // g
        base = min(orig, new) * 0.99
        width = math.ceil(6 * orig / base)
        idx = np.arange(-width, width + orig, dtype=np.float64)[None, :] / orig
        t = (np.arange(0, -new, -1, dtype=np.float64)[:, None] / new + idx) * base
        t = np.clip(t, -6, 6)
        win = np.cos(t * math.pi / 6 / 2) ** 2
        t = t * math.pi
        with np.errstate(invalid="ignore", divide="ignore"):
            k = np.where(t == 0, 1.0, np.sin(t) / t)
        k = k * win * base / orig
        xp = np.pad(x.astype(np.float64), (width, width + orig))
        frames = np.lib.stride_tricks.sliding_window_view(xp, k.shape[1])[::orig]
        y = (frames @ k.T).reshape(-1)
        return y[:math.ceil(new * len(x) / orig)].astype(np.float32)

    def _np_features(self, x, mels, n_samples):
        np = self.np
        fmax = 8000.0

        def hz_to_mel(f):
            f = np.asarray(f, dtype=np.float64)
            return np.where(f >= 1000, 15.0 + np.log(np.maximum(f, 1e-9) / 1000.0) * (27.0 / np.log(6.4)),
                            3.0 * f / 200.0)

        def mel_to_hz(m):
            return np.where(m >= 15, 1000.0 * np.exp(np.log(6.4) / 27.0 * (m - 15)), 200.0 * m / 3.0)

        ff = mel_to_hz(np.linspace(0, float(hz_to_mel(fmax)), mels + 2))
        fft = np.linspace(0, RATE // 2, 201)
        slopes = ff[None, :] - fft[:, None]
        diff = np.diff(ff)
        fb = np.maximum(0, np.minimum(-slopes[:, :-2] / diff[:-1], slopes[:, 2:] / diff[1:]))
        fb *= 2.0 / (ff[2:mels + 2] - ff[:mels])
        if n_samples:
            x = np.pad(x[:n_samples], (0, max(0, n_samples - len(x))))
        xp = np.pad(x.astype(np.float64), 200, mode="reflect")
        n_frames = 1 + (len(xp) - 400) // 160
        hann = 0.5 - 0.5 * np.cos(2 * np.pi * np.arange(400) / 400)
        fr = np.lib.stride_tricks.sliding_window_view(xp, 400)[::160][:n_frames] * hann
        spec = np.abs(np.fft.rfft(fr, axis=1)) ** 2
        mel = np.maximum(1e-10, spec @ fb).T
        log = np.log10(mel)[:, :-1]
        log = np.maximum(log, log.max() - 8.0)
        return ((log + 4.0) / 4.0).astype(np.float32)

    def features(self, x, mels, chunk, mode):
        """[windows, mels, frames] for mode "windows", [1, mels, n // 160] for "whole"."""
        np = self.np
        n_samples = int(chunk * RATE)
        if mode == "whole":
            if self.stand_in:
                return self._np_features(x, mels, 0)[None]
            fe = self.FE(feature_size=mels, chunk_length=chunk)
            return fe(x, sampling_rate=RATE, truncation=False, padding="longest",
                      return_tensors="np")["input_features"].astype(np.float32)
        windows = max(1, math.ceil(len(x) / n_samples))
        out = []
        for w in range(windows):
            seg = x[w * n_samples:(w + 1) * n_samples]
            if self.stand_in:
                out.append(self._np_features(seg, mels, n_samples))
            else:
                fe = self.FE(feature_size=mels, chunk_length=chunk)
                out.append(fe(seg, sampling_rate=RATE, return_tensors="np")["input_features"][0])
        return np.stack(out).astype(np.float32)


# ---- audio files ----

def read_wav(path, np):
    with wave.open(path, "rb") as w:
        assert w.getsampwidth() == 2, path
        ch, rate = w.getnchannels(), w.getframerate()
        data = np.frombuffer(w.readframes(w.getnframes()), dtype="<i2")
    return (data.astype(np.float32) / 32768.0).reshape(-1, ch), rate


def write_audio(path, x, rate, fmt, np, sf):
    """x: [n, channels] float in [-1, 1)."""
    x = np.clip(x, -1.0, 32767 / 32768)
    if fmt == "wav":
        q = np.round(x * 32768).astype("<i2")
        with wave.open(path, "wb") as w:
            w.setnchannels(x.shape[1])
            w.setsampwidth(2)
            w.setframerate(rate)
            w.writeframes(q.tobytes())
    elif fmt == "flac":
        sf.write(path, x, rate, format="FLAC", subtype="PCM_16")
    elif fmt == "ogg":  # in blocks: libsndfile up to 1.2.0 crashes on long Vorbis writes at once
        with sf.SoundFile(path, "w", rate, x.shape[1], format="OGG", subtype="VORBIS") as f:
            for i in range(0, len(x), 16384):
                f.write(x[i:i + 16384])
    else:
        raise ValueError(fmt)


def read_back(path, fmt, np, sf):
    if fmt == "wav":
        return read_wav(path, np)
    x, rate = sf.read(path, dtype="float32", always_2d=True)
    return x, rate


def main(argv):
    if len(argv) >= 1 and argv[0] == "filters":
        if len(argv) != 3:
            sys.exit("usage: make_audio_fixtures.py filters NPZ OUTDIR")
        filters_from_npz(argv[1], argv[2])
        return
    stand_in = "--stand-in" in argv
    args = [a for a in argv if a != "--stand-in"]
    outdir = args[0] if args else os.path.join(DATA, "audio", "generated")
    import numpy as np
    try:
        import soundfile as sf
    except ImportError:
        sf = None
        print("soundfile is missing: the FLAC and OGG cases are left out")
    ref = Reference(stand_in)
    os.makedirs(outdir, exist_ok=True)
    rng = np.random.default_rng(0)

    speech, r = read_wav(SPEECH, np)
    assert r == RATE
    speech = speech[:, 0]
    numbers = sorted(f for f in os.listdir(NUMBERS) if f.startswith("number-") and f.endswith(".wav"))
    # a minute and a half-second of speech-like audio: the fixture and the numbers, a quarter second apart
    pieces, total = [], 0
    clips = [speech] + [read_wav(os.path.join(NUMBERS, f), np)[0][:, 0] for f in numbers]
    i = 0
    while total < 60.5 * RATE:
        c = clips[i % len(clips)] * (0.6 + 0.4 * ((i * 7) % 5) / 4)
        pieces += [c, np.zeros(RATE // 4, np.float32)]
        total += len(c) + RATE // 4
        i += 1
    long16 = np.concatenate(pieces)[:int(60.5 * RATE)] + rng.normal(0, 0.003, int(60.5 * RATE))
    long16 = long16.astype(np.float32)

    def at_rate(x, rate):
        return ref.resample(x, RATE, rate)

    def stereo(x, rate):
        d = 0.1 * np.sin(2 * np.pi * 440.0 * np.arange(len(x)) / rate)
        return np.stack([x + d, x - d], axis=1)

    def synth(rate):
        t = np.arange(3 * rate) / rate
        f1 = 0.45 * rate
        chirp = 0.3 * np.sin(2 * np.pi * (50 * t + (f1 - 50) * t * t / 6))
        return (chirp + rng.normal(0, 0.02, len(t))).astype(np.float32)

    # name, samples [n, ch] at rate, rate, format, [(mels, chunk, mode)]
    cases = [
        ("speech-16000", speech[:, None], RATE, "wav", [(80, 4, "windows"), (128, 4, "windows")]),
        ("speech-16000-stereo", stereo(speech, RATE), RATE, "wav", [(80, 4, "windows")]),
        ("speech-16000", speech[:, None], RATE, "flac", [(80, 4, "windows")]),
        ("speech-16000", speech[:, None], RATE, "ogg", [(80, 4, "windows")]),
        ("long-16000", long16[:, None], RATE, "flac", [(80, 30, "windows"), (80, 30, "whole")]),
    ]
    for rate in (8000, 22050, 44100, 48000):
        s = at_rate(speech, rate)
        cases.append(("speech-%d" % rate, s[:, None], rate, "wav",
                      [(80, 4, "windows")] + ([(128, 4, "windows")] if rate == 44100 else [])))
        cases.append(("synth-%d" % rate, synth(rate)[:, None], rate, "wav", [(80, 4, "windows")]))
        if rate in (22050, 44100):
            cases.append(("speech-%d" % rate, s[:, None], rate, "ogg", [(80, 4, "windows")]))
        if rate in (44100, 48000):
            cases.append(("speech-%d-stereo" % rate, stereo(s, rate), rate, "wav" if rate == 44100 else "flac",
                          [(80, 4, "windows")]))
    cases.append(("long-44100-stereo", stereo(at_rate(long16, 44100), 44100), 44100, "ogg", [(80, 30, "windows")]))

    manifest = {"made_with": ref.made_with, "feature_path": ref.feature_path,
                "resampler": "torchaudio.functional.resample(x, rate, 16000), defaults (sinc_interp_hann, "
                             "lowpass_filter_width 6, rolloff 0.99), as transformers' ASR pipeline calls it",
                "decoder": "wave (WAV) / soundfile %s (FLAC, OGG)" % (
                    sf.__libsndfile_version__ if sf else "missing"),
                "cases": []}
    if sf:
        manifest["made_with"]["soundfile"] = sf.__version__

    def add(name, audio, rate, channels, fmt, samples16, x16, mels, chunk, mode):
        # full band: a loud chirp far above 8 kHz, which torchaudio aliases into the band
        feat = ref.features(x16, mels, chunk, mode)
        fname = "%s.%s.mel%d-%gs%s.f32" % (name, fmt, mels, chunk, "-whole" if mode == "whole" else "")
        feat.astype("<f4").tofile(os.path.join(outdir, fname))
        manifest["cases"].append({
            "name": "%s.%s mel%d %gs %s" % (name, fmt, mels, chunk, mode), "audio": audio, "features": fname,
            "mels": mels, "chunk_seconds": chunk, "mode": mode, "windows": int(feat.shape[0]),
            "frames": int(feat.shape[2]), "source_rate": rate, "channels": channels, "format": fmt,
            "samples": int(samples16), "full_band": name.startswith("synth-")})
        print("%-48s %s" % (manifest["cases"][-1]["name"], list(feat.shape)))

    for name, x, rate, fmt, feats in cases:
        if fmt != "wav" and not sf:
            continue
        audio = "%s.%s" % (name, fmt)
        path = os.path.join(outdir, audio)
        write_audio(path, x, rate, fmt, np, sf)
        back, r = read_back(path, fmt, np, sf)
        assert r == rate, (path, r)
        mono = back.astype(np.float64).mean(axis=1).astype(np.float32)
        x16 = ref.resample(mono, rate)
        for mels, chunk, mode in feats:
            add(name, audio, rate, back.shape[1], fmt, len(x16), x16, mels, chunk, mode)
    for f in numbers:  # the toy model's 4 s window, on the wavs the tests already hold
        back, r = read_wav(os.path.join(NUMBERS, f), np)
        x16 = back[:, 0]
        add(f[:-4], "../toy-numbers-whisper/" + f, r, 1, "wav", len(x16), x16, 80, 4, "windows")

    with open(os.path.join(outdir, "manifest.json"), "w") as out:
        json.dump(manifest, out, indent=1)
        out.write("\n")
    print("%d cases in %s" % (len(manifest["cases"]), outdir))


if __name__ == "__main__":
    main(sys.argv[1:])
