/* What a request may ask of this engine, checked at admission: bad input
 * and requests above a limit are refused before anything is queued. */
#include <math.h>

#include "engine/internal.h"

td_status eng_validate(const td_engine *e, const td_request *r, eng_admit *a) {
  const td_model_config *c = e->cfg;
  const td_request_params *p = &r->params;
  const char *id = r->id ? r->id : "";
  *a = (eng_admit){.whisper = c->family == TD_FAMILY_WHISPER, .ext_cross = r->cross_blocks != NULL};
  if (e->wait.n + e->run.n >= e->o.max_queue)
    return td_err(TD_ERR_OVERLOADED, "request %s: %d requests queued, the limit", id, e->o.max_queue);
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
  int n_prompt = a->n_prompt = r->n_prompt > 0 ? r->n_prompt : 1;
  if (n_prompt >= e->max_tgt)
    return td_err(TD_ERR_INVALID, "request %s: decoder prompt of %d tokens leaves no room in the model's %d positions",
                  id, n_prompt, e->max_tgt);
  for (int i = 0; i < r->n_prompt; i++)
    if (r->prompt[i] < 0 || r->prompt[i] >= c->vocab_size)
      return td_err(TD_ERR_INVALID, "request %s: decoder prompt token %d is outside the vocabulary of %d", id,
                    r->prompt[i], c->vocab_size);
  if (p->temperature < 0 || !isfinite(p->temperature) || p->top_p <= 0 || !(p->top_p <= 1.0f || p->top_p > 1.0f) ||
      p->top_k < 0)
    return td_err(TD_ERR_INVALID, "request %s: temperature must be >= 0, top_p in (0, 1], top_k >= 0", id);
  if (p->n < 1 || p->num_beams < 1 || p->n > e->o.max_running || p->num_beams > e->o.max_running ||
      p->num_beams > 32)
    return td_err(TD_ERR_INVALID, "request %s: n = %d and num_beams = %d must be between 1 and %d", id, p->n,
                  p->num_beams, e->o.max_running < 32 ? e->o.max_running : 32);
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
  if (a->beam && 2 * p->num_beams > e->smp.max_k)
    return td_err(TD_ERR_INVALID, "request %s: num_beams %d too large for this engine", id, p->num_beams);
  for (int i = 0; i < p->n_stop_ids; i++)
    if (p->stop_ids[i] < 0 || p->stop_ids[i] >= c->vocab_size)
      return td_err(TD_ERR_INVALID, "request %s: stop token %d is outside the vocabulary", id, p->stop_ids[i]);
  a->forced_bos = p->forced_bos == -2 ? e->gen->forced_bos_token_id : p->forced_bos;
  a->forced_eos = p->forced_eos == -2 ? e->gen->forced_eos_token_id : p->forced_eos;
  if (a->forced_bos >= c->vocab_size || a->forced_eos >= c->vocab_size)
    return td_err(TD_ERR_INVALID, "request %s: forced token outside the vocabulary", id);
  int room = e->max_tgt - n_prompt;
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
  if (r->prefill_only && (r->prefill_only > n_prompt || a->beam || p->n > 1))
    return td_err(TD_ERR_INVALID, "request %s: prefill of %d tokens for a prompt of %d", id, r->prefill_only,
                  n_prompt);
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
