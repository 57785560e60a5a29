/* tandem-generate: runs every request of a JSON-lines file through one
 * engine in this process (DESIGN.md §4) and prints one result line per
 * request, in input order. */
#include <errno.h>
#include <getopt.h>
#include <libgen.h>
#include <limits.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "common/clock.h"
#include "common/defaults.h"
#include "common/jsonl.h"
#include "common/log.h"
#include "common/settings.h"
#include "common/vec.h"
#include "engine/engine.h"
#include "frontend/audio.h"
#include "frontend/longform.h"
#include "frontend/tokenizer.h"

typedef struct slot {
  td_json_request req;
  char *line_out;
  float *logits;
  int n_rows;
  bool added;
  bool detect;  /* audio without a language: a detection step first */
  int32_t lang; /* ... its language token (-1: none yet) */
  /* audio past the model's window: transcribed long-form, a window at a time */
  td_longform *lf;
  float *whole; /* the whole audio's features [mels, whole_frames] */
  int whole_frames;
  bool window_ended;         /* its window's result came: fed after the step */
  td_status window_status;
  td_i32vec win_tok;
  td_f32vec win_lp;
  double win_probe;
} slot;

/* The model folder's front end, when it has one: its tokenizer (text in,
 * text in results) and, for Whisper, the feature extractor and prompt. */
typedef struct frontend {
  td_tokenizer *tok;
  td_mel *mel;
  td_whisper_prompt *whisper;
} frontend;

typedef struct app {
  slot *slots;
  int n;
  int vocab;
  int failed;
  frontend fe;
} app;

static bool has_file(const char *dir, const char *name) {
  char p[PATH_MAX];
  snprintf(p, sizeof p, "%s/%s", dir, name);
  return access(p, F_OK) == 0;
}

static td_status load_frontend(const char *dir, frontend *fe) {
  if (!has_file(dir, "tokenizer.json") && !has_file(dir, "source.spm")) return TD_OK;
  td_tokenizer_opts to = {.strict_utf8 = true}; /* bad text is refused, as the router does */
  TD_TRY(td_tokenizer_load(dir, &to, &fe->tok));
  if (!has_file(dir, "preprocessor_config.json")) return TD_OK;
  td_mel_config mc = {0};
  TD_TRY(td_mel_config_from_preprocessor(dir, &mc));
  TD_TRY(td_mel_create(&mc, &fe->mel));
  return td_whisper_prompt_load(dir, fe->tok, &fe->whisper);
}

static void free_frontend(frontend *fe) {
  td_whisper_prompt_destroy(fe->whisper);
  td_mel_destroy(fe->mel);
  td_tokenizer_destroy(fe->tok);
}

static td_status set_prompt(td_json_request *q, const int32_t *prompt, int np) {
  free(q->prompt);
  if (!(q->prompt = malloc(sizeof *q->prompt * (size_t)np))) return td_err(TD_ERR_NOMEM, "out of memory");
  memcpy(q->prompt, prompt, sizeof *prompt * (size_t)np);
  q->n_prompt = np;
  return TD_OK;
}

/* A request's text or audio as ids, or features and Whisper's prompt;
 * *detect: the audio names no language (its prompt comes after detection). */
static td_status convert(const frontend *fe, const char *model_dir, slot *sl, bool *detect) {
  td_json_request *q = &sl->req;
  if (!q->text && !q->audio) return TD_OK;
  if (!fe->tok)
    return td_err(TD_ERR_INVALID, "%s input needs a tokenizer (tokenizer.json, or Marian's source.spm) in %s",
                  q->text ? "text" : "audio", model_dir);
  if (q->text) {
    int32_t *ids = NULL;
    size_t n = 0;
    td_status st = td_tokenizer_encode(fe->tok, q->text, strlen(q->text), true, &ids, &n);
    if (st != TD_OK) return td_err_ctx(st, "text: ");
    if (!n) return td_err(TD_ERR_INVALID, "text: the tokenizer gives no tokens for it");
    q->input_ids = ids;
    q->n_input = (int)n;
    return TD_OK;
  }
  if (!fe->mel || !fe->whisper)
    return td_err(TD_ERR_INVALID, "audio input needs a Whisper checkpoint's preprocessor_config.json in %s", model_dir);
  if (q->prompt)
    return td_err(TD_ERR_INVALID, "audio input takes no decoder_prompt: Whisper's is built from language, task and "
                                  "timestamps");
  int32_t prompt[TD_WHISPER_PROMPT_MAX];
  int np = 0;
  td_status ps = td_whisper_prompt_build(fe->whisper, q->language, q->task, q->timestamps, prompt, &np);
  *detect = ps == TD_ERR_NOT_FOUND;
  if (ps != TD_OK && !*detect) return ps;
  td_audio au = {0};
  td_audio_limits lim = {0}; /* TD_DEFAULT_AUDIO_MAX_SECONDS */
  TD_TRY(td_audio_decode_memory(q->audio, q->audio_len, "audio", &lim, &au));
  int mels = td_mel_n_mels(fe->mel), wf = (int)td_mel_window_frames(fe->mel);
  q->n_features = (size_t)mels * (size_t)wf;
  q->features = malloc(sizeof *q->features * q->n_features);
  td_status s = q->features ? TD_OK : td_err(TD_ERR_NOMEM, "out of memory");
  if (s == TD_OK && au.n / TD_MEL_HOP > (size_t)wf) {
    /* long-form: the whole audio's features, as transformers takes them; the
     * first window's slice is what language detection looks at */
    sl->whole_frames = (int)(au.n / TD_MEL_HOP);
    sl->whole = malloc(sizeof *sl->whole * (size_t)mels * (size_t)sl->whole_frames);
    s = sl->whole ? td_mel_whole(fe->mel, au.samples, au.n, sl->whole) : td_err(TD_ERR_NOMEM, "out of memory");
    if (s == TD_OK) td_longform_window_features(sl->whole, mels, sl->whole_frames, 0, wf, wf, q->features);
  } else if (s == TD_OK) {
    s = td_mel_window(fe->mel, au.samples, au.n, 0, q->features);
  }
  td_audio_free(&au);
  TD_TRY(s);
  if (!*detect) TD_TRY(set_prompt(q, prompt, np));
  free(q->audio);
  q->audio = NULL;
  q->audio_len = 0;
  return TD_OK;
}

static void on_finish(void *ctx, const td_result *r) {
  app *a = ctx;
  slot *s = &a->slots[(intptr_t)r->user];
  if (s->lf && !s->detect) { /* a window: its outcome is fed once the step is over */
    s->window_ended = true;
    s->window_status = r->status;
    s->win_tok.n = s->win_lp.n = 0;
    s->win_probe = NAN;
    if (r->status != TD_OK) {
      s->line_out = td_json_error_format(r->id, r->status, r->error);
    } else if (r->n_outputs > 0) {
      const td_seq_output *o = &r->outputs[0];
      if (td_i32vec_assign(&s->win_tok, o->tokens, o->n_tokens) != TD_OK ||
          (o->logprobs && td_f32vec_append(&s->win_lp, o->logprobs, o->n_tokens) != TD_OK))
        s->window_status = TD_ERR_NOMEM;
      if (o->has_probe) s->win_probe = o->probe_prob;
    }
    return;
  }
  if (s->detect) { /* the language detection step: its token is the language */
    s->detect = false;
    s->lang = r->status == TD_OK && r->n_outputs && r->outputs[0].n_tokens ? r->outputs[0].tokens[0] : -1;
    if (r->status != TD_OK) {
      s->line_out = td_json_error_format(r->id, r->status, r->error);
      a->failed++;
    }
    return;
  }
  /* each output's text (special tokens skipped) where the folder has a tokenizer */
  td_seq_output *outs = NULL;
  char **texts = NULL;
  td_whisper_segment **ws = NULL;
  size_t *nws = NULL;
  td_text_segment **ts = NULL;
  int32_t tb = 0;
  int max_initial;
  if (s->req.timestamps && a->fe.whisper) td_whisper_timestamp_rules(a->fe.whisper, &tb, &max_initial);
  int no = r->n_outputs;
  if (r->status == TD_OK && a->fe.tok && no > 0 && (outs = calloc((size_t)no, sizeof *outs)) &&
      (texts = calloc((size_t)no, sizeof *texts)) && (ws = calloc((size_t)no, sizeof *ws)) &&
      (nws = calloc((size_t)no, sizeof *nws)) && (ts = calloc((size_t)no, sizeof *ts))) {
    for (int i = 0; i < no; i++) {
      outs[i] = r->outputs[i];
      size_t len;
      if (td_tokenizer_decode(a->fe.tok, outs[i].tokens, (size_t)outs[i].n_tokens, true, &texts[i], &len) == TD_OK)
        outs[i].text = texts[i];
      /* audio with timestamps: transformers' segments */
      if (tb > 0 && td_whisper_segments(a->fe.tok, outs[i].tokens, (size_t)outs[i].n_tokens, tb, &ws[i], &nws[i]) ==
                        TD_OK &&
          (ts[i] = calloc(nws[i] + 1, sizeof **ts))) {
        for (size_t k = 0; k < nws[i]; k++)
          ts[i][k] = (td_text_segment){.start = ws[i][k].start, .end = ws[i][k].end, .text = ws[i][k].text};
        outs[i].segments = ts[i];
        outs[i].n_segments = (int)nws[i];
      }
    }
  }
  s->line_out = r->status == TD_OK ? td_json_result_format(r->id, ts ? outs : r->outputs, no)
                                   : td_json_error_format(r->id, r->status, r->error);
  for (int i = 0; i < no; i++) {
    if (texts) free(texts[i]);
    if (ws) td_whisper_segments_free(ws[i], nws[i]);
    if (ts) free(ts[i]);
  }
  free(texts);
  free(ws);
  free(nws);
  free(ts);
  free(outs);
  if (r->status != TD_OK) a->failed++;
  if (r->logits && r->n_logit_rows) {
    s->logits = malloc(sizeof(float) * (size_t)r->n_logit_rows * a->vocab);
    if (s->logits) {
      memcpy(s->logits, r->logits, sizeof(float) * (size_t)r->n_logit_rows * a->vocab);
      s->n_rows = r->n_logit_rows;
    }
  }
}

/* ------------------------------------------------------------ long-form */

/* A long-form slot's transcription, from its language (given or detected),
 * task and long-form settings. */
static td_status longform_start(app *a, const td_model *m, slot *s) {
  const td_model_config *cfg = td_model_get_config(m);
  const td_gen_config *gen = td_model_get_gen(m);
  int32_t init[TD_WHISPER_PROMPT_MAX];
  int n_init = 0;
  const char *lang = s->lang >= 0 ? td_tokenizer_id_to_token(a->fe.tok, s->lang) : s->req.language;
  TD_TRY(td_whisper_prompt_build(a->fe.whisper, lang, s->req.task, true, init, &n_init));
  int32_t tb;
  int max_initial;
  td_whisper_timestamp_rules(a->fe.whisper, &tb, &max_initial);
  td_longform_opts o = {.window_frames = td_model_input_frames(m), .input_stride = 2,
                        .max_target_positions = cfg->max_target_len, .vocab_size = cfg->vocab_size,
                        .timestamp_begin = tb, .eos = gen->n_eos ? gen->eos_ids[0] : -1, .no_speech = tb - 2,
                        .prev_sot = td_whisper_prev_sot(a->fe.whisper), .n_init = n_init};
  memcpy(o.init, init, sizeof *init * (size_t)n_init);
  float t = s->req.params.temperature > 0 ? s->req.params.temperature : 0.0f;
  TD_TRY(td_longform_apply(&s->req.longform, t, &o));
  return td_longform_create(&o, s->whole_frames, &s->lf);
}

/* Adds the slot's next window to the engine; *done when the transcription
 * has no more. */
static td_status longform_add(app *a, td_engine *e, const td_model *m, slot *s, int i, bool *done) {
  td_longform_window w;
  *done = !td_longform_next(s->lf, &w);
  if (*done) return TD_OK;
  int mels = td_model_get_config(m)->num_mel_bins, wf = td_model_input_frames(m);
  float *f = malloc(sizeof *f * (size_t)mels * (size_t)wf);
  if (!f) return td_err(TD_ERR_NOMEM, "out of memory");
  td_longform_window_features(s->whole, mels, s->whole_frames, w.seek, w.n_frames, wf, f);
  td_request r = {.id = s->req.id, .features = f, .prompt = w.prompt, .n_prompt = w.n_prompt,
                  .user = (void *)(intptr_t)i};
  td_request_params *p = &r.params;
  td_request_params_default(p);
  p->max_new_tokens = w.max_new_tokens;
  p->temperature = w.temperature;
  p->top_k = w.temperature > 0 ? TD_LONGFORM_SAMPLE_TOP_K : 0;
  p->logprobs = w.want_logprobs;
  td_whisper_timestamp_rules(a->fe.whisper, &p->timestamp_begin, &p->max_initial_timestamp);
  if (w.probe_position >= 0) {
    p->probe = true;
    p->probe_token = w.probe_token;
    p->probe_position = w.probe_position;
  }
  uint64_t h;
  td_status st = td_engine_add(e, &r, &h); /* copies the request */
  free(f);
  return st;
}

/* The slot's result line: its segments' tokens one after another, their text
 * and the segments. */
static td_status longform_line(app *a, slot *s) {
  int n;
  const td_longform_segment *ls = td_longform_segments(s->lf, &n);
  int32_t tb;
  int max_initial;
  td_whisper_timestamp_rules(a->fe.whisper, &tb, &max_initial);
  td_i32vec all = {0}, plain = {0};
  td_text_segment *ts = calloc((size_t)n + 1, sizeof *ts);
  char **texts = calloc((size_t)n + 1, sizeof *texts);
  char *text = NULL;
  td_status st = ts && texts ? TD_OK : td_err(TD_ERR_NOMEM, "out of memory");
  for (int k = 0; k < n && st == TD_OK; k++) {
    int from = plain.n;
    for (int j = 0; j < ls[k].n_tokens && st == TD_OK; j++) {
      st = td_i32vec_push(&all, ls[k].tokens[j]);
      if (st == TD_OK && ls[k].tokens[j] < tb) st = td_i32vec_push(&plain, ls[k].tokens[j]);
    }
    size_t len;
    if (st == TD_OK) st = td_tokenizer_decode(a->fe.tok, plain.v + from, (size_t)(plain.n - from), true, &texts[k], &len);
    ts[k] = (td_text_segment){.start = ls[k].start, .end = ls[k].end, .text = texts[k]};
  }
  size_t len;
  if (st == TD_OK) st = td_tokenizer_decode(a->fe.tok, plain.v, (size_t)plain.n, true, &text, &len);
  if (st == TD_OK) {
    td_seq_output o = {.tokens = all.v, .n_tokens = all.n, .finish = TD_FINISH_STOP, .text = text,
                       .segments = ts, .n_segments = n};
    s->line_out = td_json_result_format(s->req.id, &o, 1);
  }
  for (int k = 0; texts && k < n; k++) free(texts[k]);
  free(texts);
  free(ts);
  free(text);
  td_i32vec_free(&all);
  td_i32vec_free(&plain);
  return st;
}

static void usage(FILE *f) {
  fprintf(f,
          "usage: tandem-generate --model DIR --requests FILE.jsonl [--device cpu|cuda]\n"
          "                       [--logits-out FILE] [--block-size N] [--kv-blocks N] [--cross-blocks N]\n"
          "                       [--max-batch N] [--max-tokens N] [--threads N]\n"
          "                       [--max-enc-tokens N] [--max-enc-seqs N]  (an encoder batch)\n"
          "                       [--gpu-memory-fraction F]  (the pools take what F of the GPU leaves; 0.9)\n"
          "                       [--encoder-cache-fraction F]  (of the cross pool: encoder outputs kept for\n"
          "                         repeated inputs, e.g. a document asked again; 0.25, 0 disables)\n"
          "                       [--cross-mode auto|kv|states|dual] [--states-rows N]\n"
          "                       [--cross-kv-dtype bf16|int8 (int8: the cross K/V in int8 with a scale a row,\n"
          "                        half the bytes a decode step reads; CUDA only; not the reference's bits)]\n"
          "                         (what the cross pool holds: every decoder layer's K/V, each sequence's\n"
          "                          encoder states, or both, steps of N rows or more then attending over\n"
          "                          the states; auto: dual; --cross-states: states)\n");
}

static int read_requests(const char *path, app *a) {
  FILE *f = strcmp(path, "-") ? fopen(path, "r") : stdin;
  if (!f) {
    fprintf(stderr, "tandem-generate: %s: %s\n", path, strerror(errno));
    return -1;
  }
  char dirbuf[PATH_MAX];
  snprintf(dirbuf, sizeof dirbuf, "%s", path);
  const char *base = strcmp(path, "-") ? dirname(dirbuf) : ".";
  char *line = NULL;
  size_t cap = 0;
  ssize_t len;
  int cap_slots = 0, line_no = 0;
  while ((len = getline(&line, &cap, f)) >= 0) {
    line_no++;
    while (len > 0 && (line[len - 1] == '\n' || line[len - 1] == '\r' || line[len - 1] == ' ')) len--;
    if (len == 0) continue;
    if (a->n == cap_slots) {
      cap_slots = cap_slots ? 2 * cap_slots : 64;
      slot *ns = realloc(a->slots, sizeof *ns * (size_t)cap_slots);
      if (!ns) break;
      a->slots = ns;
    }
    slot *s = &a->slots[a->n++];
    memset(s, 0, sizeof *s);
    if (td_json_request_parse(line, (size_t)len, base, line_no, &s->req) != TD_OK) {
      s->line_out = td_json_error_format(s->req.id, TD_ERR_INVALID, td_errmsg());
      a->failed++;
    }
  }
  /* every line read, or none runs: a cut file would look like a complete run */
  bool whole = feof(f);
  if (!whole) fprintf(stderr, "tandem-generate: %s: stopped at line %d: %s\n", path, line_no, strerror(errno));
  free(line);
  if (f != stdin) fclose(f);
  return whole ? 0 : -1;
}

int main(int argc, char **argv) {
  td_settings settings;
  if (td_settings_from_env(&settings) != TD_OK) {
    fprintf(stderr, "tandem-generate: %s\n", td_errmsg());
    return 2;
  }
  td_settings_apply(&settings);
  td_log_set_name("generate");
  static const struct option opts[] = {
      {"model", required_argument, 0, 'm'},      {"requests", required_argument, 0, 'r'},
      {"device", required_argument, 0, 'd'},     {"logits-out", required_argument, 0, 'l'},
      {"block-size", required_argument, 0, 'b'}, {"kv-blocks", required_argument, 0, 'k'},
      {"cross-blocks", required_argument, 0, 'c'}, {"max-batch", required_argument, 0, 'B'},
      {"max-tokens", required_argument, 0, 'T'}, {"threads", required_argument, 0, 't'},
      {"cross-states", no_argument, 0, 'C'},     {"help", no_argument, 0, 'h'},
      {"cross-mode", required_argument, 0, 'M'}, {"states-rows", required_argument, 0, 'R'},
      {"gpu-memory-fraction", required_argument, 0, 'F'}, {"max-enc-tokens", required_argument, 0, 'E'},
      {"max-enc-seqs", required_argument, 0, 'Q'}, {"encoder-cache-fraction", required_argument, 0, 'Y'},
      {"cross-kv-dtype", required_argument, 0, 'K'},
      {0, 0, 0, 0}};
  bool cross_int8 = false;
  const char *model_dir = NULL, *req_path = NULL, *device = "cpu", *logits_path = NULL;
  int block_size = TD_DEFAULT_BLOCK_SIZE, kv_blocks = 0, cross_blocks = 0, max_batch = 0,
      max_tokens = TD_DEFAULT_MAX_TOKENS, threads = 0;
  double mem_fraction = TD_DEFAULT_GPU_MEMORY_FRACTION, cache_fraction = TD_DEFAULT_ENCODER_CACHE_FRACTION;
  int max_enc_tokens = 0, max_enc_seqs = 0;
  td_cross_mode cross_mode = TD_CROSS_AUTO;
  int states_rows = 0;
  int c;
  while ((c = getopt_long(argc, argv, "m:r:d:l:b:k:c:B:T:t:ChM:R:F:E:Q:Y:K:", opts, NULL)) != -1) {
    switch (c) {
      case 'm': model_dir = optarg; break;
      case 'r': req_path = optarg; break;
      case 'd': device = optarg; break;
      case 'l': logits_path = optarg; break;
      case 'b': block_size = atoi(optarg); break;
      case 'k': kv_blocks = atoi(optarg); break;
      case 'c': cross_blocks = atoi(optarg); break;
      case 'B': max_batch = atoi(optarg); break;
      case 'T': max_tokens = atoi(optarg); break;
      case 't': threads = atoi(optarg); break;
      case 'C': cross_mode = TD_CROSS_STATES; break;
      case 'M':
        if (td_cross_mode_parse(optarg, &cross_mode) == TD_OK) break;
        fprintf(stderr, "tandem-generate: %s\n", td_errmsg());
        return 2;
      case 'R': states_rows = atoi(optarg); break;
      case 'K':
        if (strcmp(optarg, "bf16") && strcmp(optarg, "int8")) {
          fprintf(stderr, "tandem-generate: --cross-kv-dtype %s: bf16 or int8\n", optarg);
          return 2;
        }
        cross_int8 = !strcmp(optarg, "int8");
        break;
      case 'E': max_enc_tokens = atoi(optarg); break;
      case 'Q': max_enc_seqs = atoi(optarg); break;
      case 'F': {
        char *end;
        mem_fraction = strtod(optarg, &end);
        if (*end || !(mem_fraction > 0 && mem_fraction <= 1)) {
          fprintf(stderr, "tandem-generate: --gpu-memory-fraction %s: in (0, 1]\n", optarg);
          return 2;
        }
        break;
      }
      case 'Y': {
        char *end;
        cache_fraction = strtod(optarg, &end);
        if (*end || !(cache_fraction >= 0 && cache_fraction <= 1)) {
          fprintf(stderr, "tandem-generate: --encoder-cache-fraction %s: in [0, 1] (0 disables)\n", optarg);
          return 2;
        }
        break;
      }
      case 'h': usage(stdout); return 0;
      default: usage(stderr); return 2;
    }
  }
  /* a GPU runs many sequences at once: its pools come from its memory */
  bool gpu = !strcmp(device, "cuda");
  if (!max_batch) max_batch = gpu ? TD_DEFAULT_GPU_MAX_BATCH : TD_DEFAULT_MAX_SEQS;
  if (max_tokens < max_batch) max_tokens = max_batch;
  if (!max_enc_tokens) max_enc_tokens = gpu ? TD_DEFAULT_GPU_MAX_ENC_TOKENS : TD_DEFAULT_MAX_ENC_TOKENS;
  if (!max_enc_seqs) max_enc_seqs = gpu ? TD_DEFAULT_GPU_MAX_ENC_SEQS : TD_DEFAULT_MAX_ENC_SEQS;
  if (!model_dir || !req_path || block_size <= 0 || max_batch <= 0 || max_tokens <= 0 || kv_blocks < 0) {
    usage(stderr);
    return 2;
  }
  if (!gpu && strcmp(device, "cpu")) {
    fprintf(stderr, "tandem-generate: --device must be cpu or cuda\n");
    return 2;
  }
  td_backend_opts bo = {.kind = gpu ? TD_BACKEND_CUDA : TD_BACKEND_CPU, .threads = threads, .cuda = settings.cuda};
  app a = {0};
  if (read_requests(req_path, &a) != 0) return 2;
  int rc = 0;
  td_backend *b = NULL;
  td_model *m = NULL;
  td_engine *e = NULL;
  int64_t t_load = td_now_ns();
  if (td_backend_create(&bo, &b) != TD_OK) {
    fprintf(stderr, "tandem-generate: %s\n", td_errmsg());
    rc = 2;
    goto out;
  }
  td_model_opts mo = {.block_size = block_size, .max_seqs = max_batch, .max_tokens = max_tokens,
                      .max_logits = logits_path ? max_tokens : 0, .cross_mode = cross_mode,
                      .states_rows = states_rows, .tuning = settings.model, .max_enc_tokens = max_enc_tokens,
                      .max_enc_seqs = max_enc_seqs, .cross_int8 = cross_int8};
  if (td_model_load(model_dir, b, &mo, &m) != TD_OK) {
    fprintf(stderr, "tandem-generate: %s\n", td_errmsg());
    rc = 2;
    goto out;
  }
  if (load_frontend(model_dir, &a.fe) != TD_OK) {
    fprintf(stderr, "tandem-generate: %s: %s\n", model_dir, td_errmsg());
    rc = 2;
    goto out;
  }
  a.vocab = td_model_get_config(m)->vocab_size;
  size_t n_feat = (size_t)td_model_get_config(m)->num_mel_bins * td_model_input_frames(m);
  td_engine_opts eo = {.self_blocks = kv_blocks, .cross_blocks = cross_blocks, .max_running = max_batch,
                       .max_step_tokens = max_tokens, .max_queue = a.n + 1, .gpu_memory_fraction = mem_fraction,
                       .time_encoder = true, .encoder_cache_fraction = cache_fraction};
  td_engine_callbacks cb = {.on_finish = on_finish, .ctx = &a};
  if (td_engine_create(m, &eo, &cb, &e) != TD_OK) {
    fprintf(stderr, "tandem-generate: %s\n", td_errmsg());
    rc = 2;
    goto out;
  }
  double load_s = (double)(td_now_ns() - t_load) / 1e9;
  td_engine_stats st0 = td_engine_get_stats(e);
  fprintf(stderr, "tandem-generate: loaded in %.2f s on %s; %d sequences a step; pools %d self + %d cross blocks\n",
          load_s, td_backend_name(b), max_batch, st0.self.n_blocks, st0.cross.n_blocks);
  int64_t t_run = td_now_ns();
  /* text and audio to ids and features; audio without a language is detected
   * first, as transformers' detect_language: one greedy step from
   * <|startoftranscript|> over the language tokens */
  int detecting = 0;
  for (int i = 0; i < a.n; i++) {
    slot *s = &a.slots[i];
    s->lang = -1;
    if (s->line_out) continue;
    if (convert(&a.fe, model_dir, s, &s->detect) != TD_OK) {
      s->line_out = td_json_error_format(s->req.id, TD_ERR_INVALID, td_errmsg());
      a.failed++;
      continue;
    }
    if (!s->detect) continue;
    int n_langs;
    const int32_t *langs = td_whisper_languages(a.fe.whisper, &n_langs);
    int32_t sot = td_model_get_gen(m)->decoder_start_token_id;
    td_request r = {.id = s->req.id, .features = s->req.features, .prompt = &sot, .n_prompt = 1,
                    .user = (void *)(intptr_t)i};
    td_request_params_default(&r.params);
    r.params.max_new_tokens = 1;
    r.params.allowed_ids = langs;
    r.params.n_allowed = n_langs;
    uint64_t h;
    if (td_engine_add(e, &r, &h) != TD_OK) {
      s->line_out = td_json_error_format(s->req.id, TD_ERR_INVALID, td_errmsg());
      s->detect = false;
      a.failed++;
      continue;
    }
    detecting++;
  }
  while (detecting && !td_engine_idle(e)) {
    if (td_engine_step(e) != TD_OK) {
      fprintf(stderr, "tandem-generate: engine failed: %s\n", td_errmsg());
      rc = 1;
      break;
    }
  }
  for (int i = 0; i < a.n; i++) {
    slot *s = &a.slots[i];
    if (s->line_out) continue;
    if (s->whole) { /* long-form: its first window */
      bool done;
      td_status st = longform_start(&a, m, s);
      if (st == TD_OK) st = longform_add(&a, e, m, s, i, &done);
      if (st != TD_OK) {
        s->line_out = td_json_error_format(s->req.id, st, td_errmsg());
        a.failed++;
      }
      continue;
    }
    if (s->lang >= 0) { /* detected: the prompt as if the language had been given */
      int32_t prompt[TD_WHISPER_PROMPT_MAX];
      int np = 0;
      const char *tok = td_tokenizer_id_to_token(a.fe.tok, s->lang);
      if (!tok || td_whisper_prompt_build(a.fe.whisper, tok, s->req.task, s->req.timestamps, prompt, &np) != TD_OK ||
          set_prompt(&s->req, prompt, np) != TD_OK) {
        s->line_out = td_json_error_format(s->req.id, TD_ERR_INTERNAL, "language detection gave no language");
        a.failed++;
        continue;
      }
    }
    td_request r;
    td_request_from_json(&s->req, &r);
    r.user = (void *)(intptr_t)i;
    if (s->req.timestamps && a.fe.whisper)
      td_whisper_timestamp_rules(a.fe.whisper, &r.params.timestamp_begin, &r.params.max_initial_timestamp);
    r.params.all_logits = logits_path && r.params.n == 1 && r.params.num_beams == 1;
    td_status st = TD_OK;
    if (n_feat && r.features && s->req.n_features != n_feat)
      st = td_err(TD_ERR_INVALID, "request %s: input_features has %zu values, the model takes %d x %d", s->req.id,
                  s->req.n_features, td_model_get_config(m)->num_mel_bins, td_model_input_frames(m));
    else if (!n_feat && r.features)
      st = td_err(TD_ERR_INVALID, "request %s: this model takes input_ids, not input_features", s->req.id);
    uint64_t h;
    if (st == TD_OK) st = td_engine_add(e, &r, &h);
    if (st != TD_OK) {
      s->line_out = td_json_error_format(s->req.id, st, td_errmsg());
      a.failed++;
    }
  }
  while (!td_engine_idle(e)) {
    if (td_engine_step(e) != TD_OK) {
      fprintf(stderr, "tandem-generate: engine failed: %s\n", td_errmsg());
      rc = 1;
      break;
    }
    /* long-form windows that ended: fed, and the next one added (the windows
     * of every transcription decode in the same steps) */
    for (int i = 0; i < a.n; i++) {
      slot *s = &a.slots[i];
      if (!s->window_ended) continue;
      s->window_ended = false;
      if (s->window_status != TD_OK) {
        if (!s->line_out) s->line_out = td_json_error_format(s->req.id, s->window_status, td_errmsg());
        a.failed++;
        continue;
      }
      bool done = false;
      td_status st = td_longform_feed(s->lf, s->win_tok.v, s->win_tok.n, s->win_lp.n ? s->win_lp.v : NULL,
                                      s->win_probe);
      if (st == TD_OK) st = longform_add(&a, e, m, s, i, &done);
      if (st == TD_OK && done) st = longform_line(&a, s);
      if (st != TD_OK) {
        s->line_out = td_json_error_format(s->req.id, st, td_errmsg());
        a.failed++;
      }
    }
  }
  double run_s = (double)(td_now_ns() - t_run) / 1e9;
  td_engine_stats st = td_engine_get_stats(e);
  fprintf(stderr,
          "tandem-generate: %d requests in %.2f s (load not counted): %lld output tokens, %.0f tokens/s; "
          "encoder %.2f s for %lld requests; %lld steps, %lld preemptions\n",
          a.n, run_s, (long long)st.tokens_generated, run_s > 0 ? (double)st.tokens_generated / run_s : 0.0,
          st.encode_ms / 1000.0, (long long)st.encodes, (long long)st.steps, (long long)st.preemptions);
  fprintf(stderr,
          "tandem-generate: encoder cache: %lld hits, %lld misses, %lld evictions; %d entries in %d of %d blocks\n",
          (long long)st.cache_hits, (long long)st.cache_misses, (long long)st.cache_evictions, st.cache_entries,
          st.cache_blocks, st.cache_budget);
  FILE *lf = NULL;
  if (logits_path && !(lf = fopen(logits_path, "wb"))) {
    fprintf(stderr, "tandem-generate: %s: %s\n", logits_path, strerror(errno));
    rc = 1;
  }
  for (int i = 0; i < a.n; i++) {
    slot *s = &a.slots[i];
    if (s->line_out) puts(s->line_out);
    if (lf && s->logits) fwrite(s->logits, sizeof(float), (size_t)s->n_rows * a.vocab, lf);
  }
  if (lf) fclose(lf);
  fflush(stdout);
  if (rc == 0 && a.failed) rc = 1;
out:
  td_engine_destroy(e);
  free_frontend(&a.fe);
  td_model_destroy(m);
  td_backend_destroy(b);
  for (int i = 0; i < a.n; i++) {
    td_json_request_free(&a.slots[i].req);
    td_longform_destroy(a.slots[i].lf);
    free(a.slots[i].whole);
    td_i32vec_free(&a.slots[i].win_tok);
    td_f32vec_free(&a.slots[i].win_lp);
    free(a.slots[i].line_out);
    free(a.slots[i].logits);
  }
  free(a.slots);
  return rc;
}
