// A C face on libsentencepiece (C++ only): Marian checkpoints ship
// SentencePiece models, and the library is what transformers' MarianTokenizer
// runs too. Nothing C++ crosses this file's edge; every exception stops here.
#include <sentencepiece_processor.h>

#include <cstdlib>
#include <cstring>
#include <new>
#include <string>
#include <vector>

extern "C" {
#include "frontend/tokenizer_impl.h"
}

struct tk_spm {
  sentencepiece::SentencePieceProcessor sp;
};

extern "C" td_status tk_spm_load(const char *bytes, size_t len, const char *path, tk_spm **out) {
  try {
    tk_spm *s = new tk_spm;
    auto st = s->sp.LoadFromSerializedProto(std::string_view(bytes, len));
    if (!st.ok()) {
      delete s;
      return td_err(TD_ERR_FORMAT, "%s: not a SentencePiece model: %s", path, st.ToString().c_str());
    }
    *out = s;
    return TD_OK;
  } catch (const std::bad_alloc &) {
    return td_err(TD_ERR_NOMEM, "tokenizer: out of memory");
  } catch (const std::exception &e) {
    return td_err(TD_ERR_FORMAT, "%s: %s", path, e.what());
  }
}

extern "C" void tk_spm_free(tk_spm *s) { delete s; }

extern "C" td_status tk_spm_encode(const tk_spm *s, const char *text, size_t len, char ***pieces, size_t *n) {
  try {
    std::vector<std::string> v;
    auto st = s->sp.Encode(std::string_view(text, len), &v);
    if (!st.ok()) return td_err(TD_ERR_INVALID, "SentencePiece encode: %s", st.ToString().c_str());
    char **p = static_cast<char **>(calloc(v.size() + 1, sizeof *p));
    if (!p) return td_err(TD_ERR_NOMEM, "tokenizer: out of memory");
    for (size_t i = 0; i < v.size(); i++) {
      if (!(p[i] = strdup(v[i].c_str()))) {
        tk_spm_pieces_free(p, i);
        return td_err(TD_ERR_NOMEM, "tokenizer: out of memory");
      }
    }
    *pieces = p;
    *n = v.size();
    return TD_OK;
  } catch (const std::exception &e) {
    return td_err(TD_ERR_INTERNAL, "SentencePiece encode: %s", e.what());
  }
}

extern "C" void tk_spm_pieces_free(char **pieces, size_t n) {
  if (!pieces) return;
  for (size_t i = 0; i < n; i++) free(pieces[i]);
  free(pieces);
}

extern "C" td_status tk_spm_decode(const tk_spm *s, const char *const *pieces, size_t n, tk_buf *out) {
  try {
    std::vector<std::string> v(pieces, pieces + n);
    std::string text;
    auto st = s->sp.Decode(v, &text);
    if (!st.ok()) return td_err(TD_ERR_INVALID, "SentencePiece decode: %s", st.ToString().c_str());
    return tk_buf_add(out, text.data(), text.size());
  } catch (const std::exception &e) {
    return td_err(TD_ERR_INTERNAL, "SentencePiece decode: %s", e.what());
  }
}
