/* What a request may ask of this engine. Every limit is checked here, at
 * admission, and refused with an error that names it: a request that gets
 * past this always fits one step once blocks are free (the scheduler skips
 * nothing for good). */
#include <math.h>

#include "common/defaults.h"
#include "engine/internal.h"

static td_status check_input(const td_engine *e, const td_request *r, const char *id, eng_admit *a) {
  const td_model_config *c = e->cfg;
  if (a->ext_cross) {
    int want = eng_blocks_for(r->enc_len, e->bs);
    if (r->enc_len <= 0 || r->enc_len > e->max_src || r->n_cross_blocks != want || r->encode_only)
      return td_err(TD_ERR_INVALID, "request %s: %d cross blocks for an encoder output of %d tokens", id,
                    r->n_cross_blocks, r->enc_len);
    for (int i = 0; i < r->n_cross_blocks; i++)
      if (td_kv_refcount(e->cross, r->cross_blocks[i]) <= 0)
        return td_err(TD_ERR_INVALID, "request %s: cross block %d is not allocated", id, r->cross_blocks[i]);
  } else if (a->whisper) {
    if (!r->features) return td_err(TD_ERR_INVALID, "request %s: Whisper needs input features", id);
  } else {
    if (!r->input_ids || r->n_input <= 0) return td_err(TD_ERR_INVALID, "request %s: empty encoder input", id);
    if (r->n_input > e->max_src)
      return td_err(TD_ERR_INVALID, "request %s: encoder input of %d tokens exceeds the model's %d", id, r->n_input,
                    e->max_src);
    for (int i = 0; i < r->n_input; i++)
      if (r->input_ids[i] < 0 || r->input_ids[i] >= c->vocab_size)
        return td_err(TD_ERR_INVALID, "request %s: input token %d (at %d) is outside the vocabulary of %d", id,
                      r->input_ids[i], i, c->vocab_size);
  }
  if (r->n_prompt < 0 || (r->n_prompt > 0 && !r->prompt))
    return td_err(TD_ERR_INVALID, "request %s: decoder prompt of %d tokens %s", id, r->n_prompt,
                  r->n_prompt < 0 ? "(a count, at least 0)" : "given no tokens");
  a->n_prompt = r->n_prompt > 0 ? r->n_prompt : 1;
  if (a->n_prompt >= e->max_tgt)
    return td_err(TD_ERR_INVALID, "request %s: decoder prompt of %d tokens leaves no room in the model's %d positions",
                  id, a->n_prompt, e->max_tgt);
  for (int i = 0; i < r->n_prompt; i++)
    if (r->prompt[i] < 0 || r->prompt[i] >= c->vocab_size)
      return td_err(TD_ERR_INVALID, "request %s: decoder prompt token %d is outside the vocabulary of %d", id,
                    r->prompt[i], c->vocab_size);
  return TD_OK;
}

/* Sampling parameters: out of range or not a number is refused, never clamped. */
static td_status check_sampling(const td_request_params *p, const char *id) {
  if (p->temperature < 0 || !isfinite(p->temperature))
    return td_err(TD_ERR_INVALID, "request %s: temperature %g: must be a finite number >= 0", id,
                  (double)p->temperature);
  if (!(p->top_p > 0)) /* NaN too; above 1 is off */
    return td_err(TD_ERR_INVALID, "request %s: top_p %g: must be in (0, 1] (>= 1: off)", id, (double)p->top_p);
  if (p->top_k < 0) return td_err(TD_ERR_INVALID, "request %s: top_k %d: must be >= 0 (0: off)", id, p->top_k);
  if (!isfinite(p->length_penalty))
    return td_err(TD_ERR_INVALID, "request %s: length_penalty %g: must be a finite number", id,
                  (double)p->length_penalty);
  if (p->early_stopping < -1 || p->early_stopping > 1)
    return td_err(TD_ERR_INVALID, "request %s: early_stopping %d: 1 (true), 0 (false) or -1 (never)", id,
                  p->early_stopping);
  if (p->num_return_sequences < 0)
    return td_err(TD_ERR_INVALID, "request %s: num_return_sequences %d: must be >= 0 (0: one)", id,
                  p->num_return_sequences);
  if (p->n_stop_ids < 0 || (p->n_stop_ids > 0 && !p->stop_ids))
    return td_err(TD_ERR_INVALID, "request %s: %d stop token ids %s", id, p->n_stop_ids,
                  p->n_stop_ids < 0 ? "(a count, at least 0)" : "given no ids");
  if (p->n_allowed < 0 || (p->n_allowed > 0 && !p->allowed_ids))
    return td_err(TD_ERR_INVALID, "request %s: %d allowed token ids %s", id, p->n_allowed,
                  p->n_allowed < 0 ? "(a count, at least 0)" : "given no ids");
  return TD_OK;
}

/* n and num_beams against what one step always fits. */
static td_status check_width(const td_engine *e, const td_request_params *p, const char *id) {
  if (p->n < 1) return td_err(TD_ERR_INVALID, "request %s: n %d: at least 1", id, p->n);
  if (p->n > e->max_width)
    return td_err(TD_ERR_INVALID, "request %s: n %d: at most %d (this engine's %s)", id, p->n, e->max_width,
                  e->width_limit);
  if (p->num_beams < 1) return td_err(TD_ERR_INVALID, "request %s: num_beams %d: at least 1", id, p->num_beams);
  if (p->num_beams > TD_ENGINE_MAX_BEAMS)
    return td_err(TD_ERR_INVALID, "request %s: num_beams %d: at most %d (this engine's limit)", id, p->num_beams,
                  TD_ENGINE_MAX_BEAMS);
  if (p->num_beams > e->max_width)
    return td_err(TD_ERR_INVALID, "request %s: num_beams %d: at most %d (this engine's %s)", id, p->num_beams,
                  e->max_width, e->width_limit);
  return TD_OK;
}

td_status eng_validate(const td_engine *e, const td_request *r, eng_admit *a) {
  const td_model_config *c = e->cfg;
  const td_request_params *p = &r->params;
  const char *id = r->id ? r->id : "";
  *a = (eng_admit){.whisper = c->family == TD_FAMILY_WHISPER, .ext_cross = r->cross_blocks != NULL};
  if (e->wait.n + e->run.n >= e->o.max_queue)
    return td_err(TD_ERR_OVERLOADED, "request %s: %d requests queued, the limit", id, e->o.max_queue);
  TD_TRY(check_input(e, r, id, a));
  TD_TRY(check_sampling(p, id));
  TD_TRY(check_width(e, p, id));
  a->beam = p->num_beams > 1;
  if (a->beam && (p->n > 1 || p->temperature > 0))
    return td_err(TD_ERR_UNSUPPORTED, "request %s: beam search with sampling (n or temperature) is not supported", id);
  int nret = p->num_return_sequences > 0 ? p->num_return_sequences : 1;
  if (a->beam && nret > p->num_beams)
    return td_err(TD_ERR_INVALID, "request %s: num_return_sequences %d exceeds num_beams %d", id, nret, p->num_beams);
  if (!a->beam && p->num_return_sequences > 1 && p->num_return_sequences != p->n)
    return td_err(TD_ERR_INVALID, "request %s: num_return_sequences needs num_beams > 1 (use n for samples)", id);
  if (p->all_logits && (a->beam || p->n > 1))
    return td_err(TD_ERR_INVALID, "request %s: all logits are kept for single greedy or sampled requests only", id);
  if (p->all_logits && (r->encode_only || r->prefill_only))
    return td_err(TD_ERR_INVALID, "request %s: all logits are kept for decoding requests only", id);
  if (p->all_logits && e->max_rows < 2)
    return td_err(TD_ERR_INVALID, "request %s: all logits need 2 logit rows a step; this engine has %d (max_logits)",
                  id, e->max_rows);
  if (p->probe && !r->encode_only && !r->prefill_only) {
    /* encoder and prefill work leaves the probe to the worker that decodes */
    if (p->probe_token < 0 || p->probe_token >= c->vocab_size)
      return td_err(TD_ERR_INVALID, "request %s: probe token %d is outside the vocabulary of %d", id, p->probe_token,
                    c->vocab_size);
    if (p->probe_position < 0 || p->probe_position >= a->n_prompt)
      return td_err(TD_ERR_INVALID, "request %s: probe position %d is outside the decoder prompt of %d tokens", id,
                    p->probe_position, a->n_prompt);
    if (r->self_blocks && p->probe_position < r->n_computed)
      return td_err(TD_ERR_INVALID,
                    "request %s: probe position %d was prefilled elsewhere (%d prompt tokens came computed)", id,
                    p->probe_position, r->n_computed);
    if (p->all_logits)
      return td_err(TD_ERR_INVALID, "request %s: a probe and all logits: one or the other", id);
    if (e->max_rows < 2)
      return td_err(TD_ERR_INVALID, "request %s: a probe needs 2 logit rows a step; this engine has %d (max_logits)",
                    id, e->max_rows);
  }
  if (a->beam && 2 * p->num_beams > e->smp.max_k)
    return td_err(TD_ERR_INVALID,
                  "request %s: num_beams %d: at most %d (2 x num_beams candidates from a vocabulary of %d)", id,
                  p->num_beams, e->smp.max_k / 2, e->V);
  if (p->timestamp_begin < 0 || p->timestamp_begin >= c->vocab_size)
    return td_err(TD_ERR_INVALID, "request %s: timestamp_begin %d is outside the vocabulary", id, p->timestamp_begin);
  if (p->max_initial_timestamp >= c->vocab_size)
    return td_err(TD_ERR_INVALID, "request %s: max_initial_timestamp %d is past the vocabulary", id,
                  p->max_initial_timestamp);
  /* earlier attempts' tokens are the prompt's tail: the timestamp rules read behind them */
  if (r->step_offset && (int64_t)r->step_offset >= a->n_prompt)
    return td_err(TD_ERR_INVALID, "request %s: %u tokens of earlier attempts in a prompt of %d", id, r->step_offset,
                  a->n_prompt);
  for (int i = 0; i < p->n_allowed; i++)
    if (p->allowed_ids[i] < 0 || p->allowed_ids[i] >= c->vocab_size)
      return td_err(TD_ERR_INVALID, "request %s: allowed token %d is outside the vocabulary", id, p->allowed_ids[i]);
  for (int i = 0; i < p->n_stop_ids; i++)
    if (p->stop_ids[i] < 0 || p->stop_ids[i] >= c->vocab_size)
      return td_err(TD_ERR_INVALID, "request %s: stop token %d is outside the vocabulary", id, p->stop_ids[i]);
  if (p->forced_bos < -2 || p->forced_eos < -2)
    return td_err(TD_ERR_INVALID, "request %s: forced BOS %d / EOS %d: -2 (the model's), -1 (none) or a token id", id,
                  p->forced_bos, p->forced_eos);
  a->forced_bos = p->forced_bos == -2 ? e->gen->forced_bos_token_id : p->forced_bos;
  a->forced_eos = p->forced_eos == -2 ? e->gen->forced_eos_token_id : p->forced_eos;
  if (a->forced_bos >= c->vocab_size || a->forced_eos >= c->vocab_size)
    return td_err(TD_ERR_INVALID, "request %s: forced BOS %d / EOS %d: outside the vocabulary of %d", id, a->forced_bos,
                  a->forced_eos, c->vocab_size);
  int n_prompt = a->n_prompt, room = e->max_tgt - n_prompt;
  /* max_new_tokens <= 0 is documented: generation_config's max_length, or the room left */
  int max_new = p->max_new_tokens;
  if (max_new <= 0) max_new = e->gen->max_length > n_prompt ? e->gen->max_length - n_prompt : room;
  if (max_new > room) {
    if (p->max_new_tokens > 0)
      return td_err(TD_ERR_INVALID, "request %s: prompt %d + max_new_tokens %d exceeds the model's %d positions", id,
                    n_prompt, p->max_new_tokens, e->max_tgt);
    max_new = room;
  }
  a->max_new = max_new;
  if (r->self_blocks) {
    if (r->n_computed <= 0 || r->n_computed >= n_prompt + (r->prefill_only ? 1 : 0) ||
        r->n_self_blocks != eng_blocks_for(r->n_computed, e->bs))
      return td_err(TD_ERR_INVALID, "request %s: %d self blocks for %d computed prompt tokens", id, r->n_self_blocks,
                    r->n_computed);
    for (int i = 0; i < r->n_self_blocks; i++)
      if (td_kv_refcount(e->self, r->self_blocks[i]) <= 0)
        return td_err(TD_ERR_INVALID, "request %s: self block %d is not allocated", id, r->self_blocks[i]);
  }
  int computed = r->self_blocks ? r->n_computed : 0;
  if (r->prefill_only < 0 ||
      (r->prefill_only && (r->prefill_only > n_prompt || r->prefill_only <= computed || a->beam || p->n > 1)))
    return td_err(TD_ERR_INVALID, "request %s: prefill of %d tokens for a prompt of %d (%d computed)", id,
                  r->prefill_only, n_prompt, computed);
  if (r->encode_only && (r->prefill_only || r->self_blocks))
    return td_err(TD_ERR_INVALID, "request %s: encode_only excludes other work", id);
  a->enc_len = a->ext_cross ? r->enc_len : a->whisper ? e->max_src : r->n_input;
  a->width = a->beam ? p->num_beams : p->n;
  int need_self = a->width * (eng_blocks_for(n_prompt + max_new, e->bs) + 1);
  int need_cross = eng_blocks_for(a->enc_len, e->bs);
  if ((!r->encode_only && need_self > e->o.self_blocks) || need_cross > e->o.cross_blocks)
    return td_err(TD_ERR_NO_BLOCKS,
                  "request %s needs up to %d self-attention and %d cross-attention blocks; the pools hold %d and %d", id,
                  need_self, need_cross, e->o.self_blocks, e->o.cross_blocks);
  if (!a->ext_cross && a->enc_len > e->o.max_enc_tokens)
    return td_err(TD_ERR_INVALID, "request %s: encoder input of %d tokens exceeds the %d per step", id, a->enc_len,
                  e->o.max_enc_tokens);
  return TD_OK;
}
