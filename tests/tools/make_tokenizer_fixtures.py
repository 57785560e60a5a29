#!/usr/bin/env python3
"""Build tokenizers as transformers' own converters produce them, with their
encode / decode cases, for tests/unit/test_tokenizer.c.

    python3 tests/tools/make_tokenizer_fixtures.py \\
        --assets ../shared/fixtures/frontend/whisper-assets \\
        --out tests/data/tokenizers [family ...]

families: t5 (T5TokenizerFast from a SentencePiece Unigram model trained here,
with its precompiled charsmap), bart (BartTokenizerFast from the GPT-2
vocabulary in gpt2.tiktoken), whisper (WhisperTokenizerFast from
multilingual.tiktoken through convert_tiktoken_to_hf, 51,866 tokens as
large-v3), marian (MarianTokenizer: two SentencePiece models trained here and
a joint vocab.json). Default: all four. marian-local (not by default) needs
only sentencepiece: the same kind of Marian folder, its cases computed by
following transformers 5's MarianTokenizer steps with sentencepiece itself
(cases.json), so the spm path is tested where transformers is absent
(--keep-models: new cases for the models already there, as retraining is not
byte-reproducible); precompiled-local (sentencepiece only, not by default)
checks the Precompiled normalizer against sentencepiece's own nmt_nfkc
normalization.

Each family gets a folder OUT/<name>/ holding the checkpoint files Tandem
reads (tokenizer.json + tokenizer_config.json, or Marian's source.spm,
target.spm, vocab.json, tokenizer_config.json) and cases.transformers.json:

    {"source": "...versions...", "cases": [
        {"text": str | "text_hex": hex bytes, "ids": [...], "decoded": str, "decoded_skip": str},
        {"decode_ids": [...], "decoded": str, "decoded_skip": str}, ...]}

ids = tok(text)["input_ids"] (special tokens added as the tokenizer does by
default); decoded / decoded_skip = tok.decode(ids, skip_special_tokens=False /
True). Invalid UTF-8 is given as text_hex; its ids are those of the text
decoded with errors="replace" (what a caller must do before transformers).

Needs transformers, tokenizers, sentencepiece (and protobuf for the slow ->
fast conversion); downloads nothing.
"""
import argparse
import json
import os
import random
import shutil
import sys
import tempfile
import traceback
from base64 import b64decode

import sentencepiece as spm

try:  # marian-local needs sentencepiece alone
    import tokenizers
    import transformers
except ImportError:
    tokenizers = transformers = None

CORPUS = """The quick brown fox jumps over the lazy dog.
Paged attention serves many requests at once, 2026!
It isn't so, right? I'm here, you're there, we've been everywhere.
naïve café résumé Ångström Größe façade crème brûlée jalapeño
Numbers: 0 1 2 3 4 5 6 7 8 9 10 42 305 1999 4207 3.14 1,000,000
Der schnelle braune Fuchs springt über den faulen Hund.
Le renard brun rapide saute par-dessus le chien paresseux.
El rápido zorro marrón salta sobre el perro perezoso.
日本語のテキストを分割します。東京は大きい都市です。
中文测试文本，我们在这里写一些句子。
한국어 텍스트를 나눕니다.
Привет мир, как дела?
Hello world! Hello again, world. Goodbye, world.
Tokenizers split text into pieces: words, subwords and bytes.
"""

TEXTS = [
    "", "Hello world", "The quick brown fox jumps over the lazy dog.",
    "naïve café résumé Ångström", "Größe façade crème brûlée", "e\u0301 a\u0300 n\u0303 (combining marks)",
    "ﬁ ligature, ① circled, Ｆｕｌｌｗｉｄｔｈ, ½ fraction, ㎞",  # NFKC / charsmap territory
    "\u1100\u1161 jamo, \uff76\uff9e kana, e\u0301\u0302 two marks",  # graphemes the charsmap rule treats apart
    "日本語のテキスト", "中文测试", "한국어 텍스트", "Привет мир", "مرحبا بالعالم", "שלום עולם", "ภาษาไทย",
    "🌶️ 🙂👍🏽 👨‍👩‍👧 🇫🇷", "emoji🙂inside", "  leading spaces", "trailing spaces   ", "a\t\tb\n\nc",
    "multiple     spaces    here", "\u3000ideographic space", "non\u00a0breaking", "zero\u200bwidth",
    "It isn't so , right ? I 'm here . You 're ok !", "Numbers: 2026 3.14 1,000,000 0007",
    "Hello!!! ??? ... --- (brackets) [x] {y} <z>", "UPPER lower MiXeD", "line one\nline two\r\nline three",
    "control \x01\x02 chars", "tab\there", "x" * 300,
    " ".join(["Paged attention serves many requests at once; each one gets its own blocks."] * 25),
]

INVALID = [b"ab\xc3(", b"\xff\xfe", b"caf\xe9", b"\xf0\x9f\x98", b"ok \xed\xa0\x80 surrogate", b"\x80start"]

SPECIAL_TEXTS = {
    "t5": ["Hello</s>", "a <pad> b", "<unk>?", "<extra_id_0> fills <extra_id_1>", "x</s></s>y"],
    "bart": ["<s>Hello</s>", "a <mask> b", "a<mask>b", "<pad><unk>", "Hello <mask>!"],
    "whisper": ["<|endoftext|>", "<|en|>Hello", "text <|0.00|> time <|1.50|>", "<|startoftranscript|><|de|><|translate|>",
                "<|notimestamps|> plain"],
    "marian": ["Hello</s>", ">>de<< Hello world", "a <unk> b", ">>fr<< >>de<< two codes", "<pad>x",
               "a >>de<< b", " >>de<< lead", ">>de<<fr<< x<<", ">>de no end", ">>zz<< unknown", "x</s>>>fr<<y"],
}


def versions():
    if transformers is None:
        return f"sentencepiece {spm.__version__}"
    return f"transformers {transformers.__version__}, tokenizers {tokenizers.__version__}, sentencepiece {spm.__version__}"


def cls(*names):
    for n in names:
        c = getattr(transformers, n, None)
        if c is not None:
            return c
    raise RuntimeError(f"transformers has none of {names}")


def train_spm(work, name, vocab_size, text, **kw):
    corpus = os.path.join(work, f"{name}.txt")
    with open(corpus, "w", encoding="utf-8") as f:
        for _ in range(20):
            f.write(text)
    prefix = os.path.join(work, name)
    spm.SentencePieceTrainer.train(input=corpus, model_prefix=prefix, vocab_size=vocab_size, model_type="unigram",
                                   character_coverage=0.98, normalization_rule_name="nmt_nfkc",
                                   hard_vocab_limit=False, **kw)
    return prefix + ".model"


def cases(tok, family, seed):
    out = []
    for text in TEXTS + SPECIAL_TEXTS[family]:
        ids = tok(text)["input_ids"]
        out.append({"text": text, "ids": ids, "decoded": tok.decode(ids, skip_special_tokens=False),
                    "decoded_skip": tok.decode(ids, skip_special_tokens=True)})
    for raw in INVALID:
        ids = tok(raw.decode("utf-8", errors="replace"))["input_ids"]
        out.append({"text_hex": raw.hex(), "ids": ids, "decoded": tok.decode(ids, skip_special_tokens=False),
                    "decoded_skip": tok.decode(ids, skip_special_tokens=True)})
    rng = random.Random(seed)
    n = len(tok)
    special = sorted(set(tok.all_special_ids))
    for k in range(40):  # any ids: pieces of characters, specials in the middle
        ids = [rng.randrange(n) for _ in range(1 + k % 24)]
        if special and k % 3 == 0:
            ids.insert(rng.randrange(len(ids) + 1), rng.choice(special))
        out.append({"decode_ids": ids, "decoded": tok.decode(ids, skip_special_tokens=False),
                    "decoded_skip": tok.decode(ids, skip_special_tokens=True)})
    return out


def write(outdir, name, tok, family, seed, keep):
    d = os.path.join(outdir, name)
    os.makedirs(d, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        tok.save_pretrained(tmp)
        for f in keep:
            if not os.path.exists(os.path.join(tmp, f)):
                raise RuntimeError(f"{name}: save_pretrained wrote no {f} (wrote {sorted(os.listdir(tmp))})")
            shutil.copy(os.path.join(tmp, f), os.path.join(d, f))
    cs = cases(tok, family, seed)
    doc = {"source": f"tests/tools/make_tokenizer_fixtures.py, {type(tok).__name__}, {versions()}", "cases": cs}
    with open(os.path.join(d, "cases.transformers.json"), "w", encoding="utf-8") as f:
        json.dump(doc, f, ensure_ascii=False, indent=0)
    print(f"{name}: {type(tok).__name__}, {len(tok)} tokens, {len(cs)} cases -> {d}")


def make_t5(args, work):
    model = train_spm(work, "t5", 400, CORPUS, pad_id=0, eos_id=1, unk_id=2, bos_id=-1)
    tok = cls("T5TokenizerFast", "T5Tokenizer")(vocab_file=model, extra_ids=10)
    if not getattr(tok, "is_fast", False):
        raise RuntimeError("T5: no fast tokenizer (tokenizer.json) was built")
    write(args.out, "t5-spm", tok, "t5", 1, ["tokenizer.json", "tokenizer_config.json"])


def read_tiktoken(path):
    ranks = {}
    with open(path, "rb") as f:
        for line in f:
            if line.strip():
                tok, rank = line.split()
                ranks[b64decode(tok)] = int(rank)
    return ranks


def bytes_to_unicode():
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, map(chr, cs)))


def tiktoken_to_vocab_merges(ranks):
    """vocab (token text -> rank) and merges, as transformers' tiktoken converter recovers them."""
    enc = bytes_to_unicode()
    text = lambda b: "".join(enc[x] for x in b)

    def bpe(token, max_rank):
        parts = [bytes([b]) for b in token]
        while True:
            best = None
            for i in range(len(parts) - 1):
                r = ranks.get(parts[i] + parts[i + 1])
                if r is not None and (best is None or r < best[1]):
                    best = (i, r)
            if best is None or best[1] >= max_rank:
                return parts
            i = best[0]
            parts = parts[:i] + [parts[i] + parts[i + 1]] + parts[i + 2:]

    vocab, merges = {}, []
    for token, rank in sorted(ranks.items(), key=lambda kv: kv[1]):
        vocab[text(token)] = rank
        if len(token) > 1:
            parts = bpe(token, rank)
            if len(parts) != 2:
                raise RuntimeError(f"token {token!r} does not split into one merge")
            merges.append(f"{text(parts[0])} {text(parts[1])}")
    return vocab, merges


def make_bart(args, work):
    ranks = read_tiktoken(os.path.join(args.assets, "gpt2.tiktoken"))
    vocab, merges = tiktoken_to_vocab_merges(ranks)
    # BART's layout: the four fairseq specials first, GPT-2's pieces after, <mask> last
    full = {"<s>": 0, "<pad>": 1, "</s>": 2, "<unk>": 3}
    for t, r in sorted(vocab.items(), key=lambda kv: kv[1]):
        full[t] = r + 4
    full["<mask>"] = len(full)
    vf, mf = os.path.join(work, "vocab.json"), os.path.join(work, "merges.txt")
    with open(vf, "w", encoding="utf-8") as f:
        json.dump(full, f, ensure_ascii=False)
    with open(mf, "w", encoding="utf-8") as f:
        f.write("#version: 0.2\n" + "\n".join(merges) + "\n")
    tok = cls("BartTokenizerFast", "BartTokenizer")(vocab_file=vf, merges_file=mf)
    if not getattr(tok, "is_fast", False):
        raise RuntimeError("BART: no fast tokenizer (tokenizer.json) was built")
    write(args.out, "bart-gpt2", tok, "bart", 2, ["tokenizer.json", "tokenizer_config.json"])


def make_whisper(args, work):
    from transformers.models.whisper import convert_openai_to_hf as conv
    local = os.path.abspath(os.path.join(args.assets, "multilingual.tiktoken"))
    if hasattr(conv, "_TOKENIZERS"):
        for key in list(conv._TOKENIZERS):  # point the converter at the local file, not a URL
            conv._TOKENIZERS[key] = local
        slow = conv.convert_tiktoken_to_hf(multilingual=True, num_languages=100)
    else:  # the converter's own steps, from the local file
        from transformers.models.whisper.tokenization_whisper import LANGUAGES
        vocab, merges = tiktoken_to_vocab_merges(read_tiktoken(local))
        vf, mf = os.path.join(work, "src-vocab.json"), os.path.join(work, "src-merges.txt")
        with open(vf, "w", encoding="utf-8") as f:
            json.dump(vocab, f, ensure_ascii=False)
        with open(mf, "w", encoding="utf-8") as f:
            f.write("#version: 0.2\n" + "\n".join(merges) + "\n")
        slow = cls("WhisperTokenizer")(vf, mf)
        control = ["<|translate|>", "<|transcribe|>", "<|startoflm|>", "<|startofprev|>", "<|nospeech|>",
                   "<|notimestamps|>"]
        langs = [f"<|{k}|>" for k in list(LANGUAGES)[:100]]
        slow.add_tokens(["<|endoftext|>", "<|startoftranscript|>"] + langs + control, special_tokens=True)
        slow.add_tokens(["<|%.2f|>" % (i * 0.02) for i in range(1501)], special_tokens=False)
    slow.save_pretrained(work)
    fast = cls("WhisperTokenizerFast", "WhisperTokenizer").from_pretrained(work, language="english", task="transcribe",
                                                                            predict_timestamps=False)
    if not getattr(fast, "is_fast", False):
        raise RuntimeError("Whisper: no fast tokenizer (tokenizer.json) was built")
    if len(fast) != 51866:
        raise RuntimeError(f"Whisper: {len(fast)} tokens, large-v3 has 51866")
    write(args.out, "whisper-v3-fast", fast, "whisper", 3, ["tokenizer.json", "tokenizer_config.json"])


def make_marian(args, work):
    src = train_spm(work, "marian-src", 300, CORPUS, pad_id=-1, eos_id=1, unk_id=2, bos_id=-1)
    tgt = train_spm(work, "marian-tgt", 280, CORPUS.lower(), pad_id=-1, eos_id=1, unk_id=2, bos_id=-1)
    vocab = {"</s>": 0, "<unk>": 1, ">>de<<": 2, ">>fr<<": 3}
    for m in (src, tgt):
        p = spm.SentencePieceProcessor(model_file=m)
        for i in range(p.get_piece_size()):
            vocab.setdefault(p.id_to_piece(i), len(vocab))
    vocab["<pad>"] = len(vocab)
    vf = os.path.join(work, "vocab.json")
    with open(vf, "w", encoding="utf-8") as f:
        json.dump(vocab, f, ensure_ascii=False)
    tok = cls("MarianTokenizer")(source_spm=src, target_spm=tgt, vocab=vf, source_lang="en", target_lang="de")
    write(args.out, "marian-spm", tok, "marian", 4, ["source.spm", "target.spm", "vocab.json", "tokenizer_config.json"])


def make_marian_local(args, work):
    import re
    d = os.path.join(args.out, "marian-local")
    os.makedirs(d, exist_ok=True)
    files = [os.path.join(d, f) for f in ("source.spm", "target.spm", "vocab.json")]
    if args.keep_models and all(map(os.path.exists, files)):  # new cases for the models already there
        sp_src, sp_tgt = (spm.SentencePieceProcessor(model_file=f) for f in files[:2])
        with open(files[2], encoding="utf-8") as f:
            vocab = json.load(f)
    else:  # a rerun of training gives other bytes, so new models
        src = train_spm(work, "source", 200, CORPUS, pad_id=-1, eos_id=1, unk_id=2, bos_id=-1)
        tgt = train_spm(work, "target", 180, CORPUS.lower(), pad_id=-1, eos_id=1, unk_id=2, bos_id=-1)
        vocab = {"</s>": 0, "<unk>": 1, ">>de<<": 2, ">>fr<<": 3}
        sp_src, sp_tgt = spm.SentencePieceProcessor(model_file=src), spm.SentencePieceProcessor(model_file=tgt)
        for p in (sp_src, sp_tgt):
            for i in range(p.get_piece_size()):
                vocab.setdefault(p.id_to_piece(i), len(vocab))
        vocab["<pad>"] = len(vocab)
        shutil.copy(src, files[0])
        shutil.copy(tgt, files[1])
        with open(files[2], "w", encoding="utf-8") as f:
            json.dump(vocab, f, ensure_ascii=False)
    inv = {i: t for t, i in vocab.items()}
    specials = ["</s>", "<unk>", "<pad>"]

    def encode(text):  # transformers 5: PythonBackend.tokenize + MarianTokenizer._tokenize + </s>
        ids = []
        for chunk in re.split("(" + "|".join(map(re.escape, specials)) + ")", text):
            if not chunk:
                continue
            if chunk in specials:
                ids.append(vocab[chunk])
                continue
            code = []  # remove_language_code: only at the start, up to the first "<<"
            if chunk.startswith(">>") and (end := chunk.find("<<")) != -1:
                code, chunk = [chunk[:end + 2]], chunk[end + 2:]
            ids += [vocab.get(p, vocab["<unk>"]) for p in code + sp_src.encode(chunk, out_type=str)]
        return ids + [vocab["</s>"]]

    def decode(ids, skip):  # convert_ids_to_tokens + convert_tokens_to_string, source spm (joint vocab)
        out, run = "", []
        for t in (inv[i] for i in ids):
            if t in specials:
                if skip:
                    continue
                out += sp_src.decode_pieces(run) + t + " "
                run = []
            else:
                run.append(t)
        return (out + sp_src.decode_pieces(run)).replace("\u2581", " ").strip()

    cs = []
    for text in TEXTS + SPECIAL_TEXTS["marian"]:
        ids = encode(text)
        cs.append({"text": text, "ids": ids, "decoded": decode(ids, False), "decoded_skip": decode(ids, True)})
    rng = random.Random(5)
    for k in range(30):
        ids = [rng.randrange(len(vocab)) for _ in range(1 + k % 20)]
        cs.append({"decode_ids": ids, "decoded": decode(ids, False), "decoded_skip": decode(ids, True)})
    doc = {"source": "tests/tools/make_tokenizer_fixtures.py marian-local: transformers 5's MarianTokenizer steps "
                     f"followed with sentencepiece's Python binding, not transformers ({versions()})", "cases": cs}
    with open(os.path.join(d, "cases.json"), "w", encoding="utf-8") as f:
        json.dump(doc, f, ensure_ascii=False, indent=0)
    print(f"marian-local: {len(vocab)} pieces, {len(cs)} cases -> {d}")


def spm_charsmap(model_path):
    """NormalizerSpec.precompiled_charsmap of a .model file (protobuf read by hand: field 3, then 2)."""
    def fields(b):
        i = 0
        while i < len(b):
            key, i = varint(b, i)
            f, wt = key >> 3, key & 7
            if wt == 0:
                v, i = varint(b, i)
            elif wt == 1:
                v, i = b[i:i + 8], i + 8
            elif wt == 2:
                n, i = varint(b, i)
                v, i = b[i:i + n], i + n
            elif wt == 5:
                v, i = b[i:i + 4], i + 4
            else:
                raise ValueError("unexpected wire type")
            yield f, v

    def varint(b, i):
        v = s = 0
        while True:
            c = b[i]
            i += 1
            v |= (c & 0x7F) << s
            s += 7
            if c < 0x80:
                return v, i

    with open(model_path, "rb") as f:
        model = f.read()
    spec = next(v for f, v in fields(model) if f == 3)
    return next(v for f, v in fields(spec) if f == 2)


def make_precompiled_local(args, work):
    """The nmt_nfkc charsmap alone (a Precompiled normalizer, bytes out through
    ByteLevel), against sentencepiece's own normalization of the same texts."""
    from base64 import b64encode
    d = os.path.join(args.out, "precompiled-nmt-nfkc")
    os.makedirs(d, exist_ok=True)
    model = train_spm(work, "charsmap", 120, CORPUS, pad_id=-1, eos_id=1, unk_id=2, bos_id=-1)
    sp = spm.SentencePieceProcessor(model_file=model)
    enc = bytes_to_unicode()
    tok = {"version": "1.0", "added_tokens": [],
           "normalizer": {"type": "Precompiled", "precompiled_charsmap": b64encode(spm_charsmap(model)).decode()},
           "pre_tokenizer": {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": False},
           "post_processor": None, "decoder": {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True,
                                               "use_regex": False},
           "model": {"type": "BPE", "vocab": {enc[b]: b for b in range(256)}, "merges": []}}
    with open(os.path.join(d, "tokenizer.json"), "w", encoding="utf-8") as f:
        json.dump(tok, f, ensure_ascii=False)
    # not here: graphemes of 6 bytes or more (Hangul jamo, halfwidth kana with
    # voicing), graphemes of several marks, and white space alone, where
    # tokenizers' per-grapheme rule and sentencepiece part ways; the
    # transformers cases cover those
    texts = ["\ufb01ne", "\u2460\u2461", "\uff26\uff55\uff4c\uff4c", "\u00bd", "\u338e", "caf\u00e9", "cafe\u0301",
             "\u212b", "\u2122", "\u2026", "x\u00a0y", "a\u3000b", "A\u030a", "\u00c5", "\ufe64", "\u2474",
             "\u33a1", "a\u2000b", "\ud55c\uad6d\uc5b4", "\u65e5\u672c", "\u0130", "\uff76"]
    cs = []
    for t in texts:
        norm = "".join(sp.encode(t, out_type=str))  # the pieces cover the normalized text
        norm = norm[1:] if norm.startswith("\u2581") else norm
        norm = norm.replace("\u2581", " ")
        cs.append({"text": t, "ids": list(norm.encode("utf-8"))})
    doc = {"source": "tests/tools/make_tokenizer_fixtures.py precompiled-local: sentencepiece's own nmt_nfkc "
                     f"normalization of each text as its ids (one a byte) ({versions()})", "cases": cs}
    with open(os.path.join(d, "cases.json"), "w", encoding="utf-8") as f:
        json.dump(doc, f, ensure_ascii=False, indent=0)
    print(f"precompiled-local: {len(cs)} cases -> {d}")


FAMILIES = {"t5": make_t5, "bart": make_bart, "whisper": make_whisper, "marian": make_marian,
            "marian-local": make_marian_local, "precompiled-local": make_precompiled_local}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--assets", required=True, help="folder with gpt2.tiktoken and multilingual.tiktoken")
    ap.add_argument("--out", required=True, help="tests/data/tokenizers")
    ap.add_argument("--keep-models", action="store_true",
                    help="marian-local: new cases for the source.spm, target.spm and vocab.json already in OUT")
    ap.add_argument("families", nargs="*", default=["t5", "bart", "whisper", "marian"])
    args = ap.parse_args()
    print(versions())
    local = {"marian-local", "precompiled-local"}
    if transformers is None and set(args.families) - local:
        sys.exit("transformers and tokenizers are needed for " + " ".join(sorted(set(args.families) - local)))
    failed = []
    for fam in args.families:
        with tempfile.TemporaryDirectory() as work:
            try:
                FAMILIES[fam](args, work)
            except Exception:
                traceback.print_exc()
                failed.append(fam)
    if failed:
        print("FAILED:", " ".join(failed))
        sys.exit(1)


if __name__ == "__main__":
    main()
