// The official openai Node client against tandem-gateway (run by
// test_gateway.sh from the folder where npm installed the client).
//   node gateway_openai.mjs text URL MODEL
//   node gateway_openai.mjs audio URL MODEL WAV_DIR
//   node gateway_openai.mjs keys URL MODEL KEY   (a gateway started with --api-keys)
import fs from 'node:fs';
import OpenAI, { toFile } from 'openai';

const [mode, url, model, wavs] = process.argv.slice(2);
const client = new OpenAI({ baseURL: `${url}/v1`, apiKey: mode === 'keys' ? wavs : 'none', maxRetries: 0,
                           timeout: 60000 });
let failed = 0;
function check(what, ok, got) {
  console.log(`${ok ? 'ok  ' : 'FAIL'} node: ${what}${ok ? '' : `: got ${JSON.stringify(got)}`}`);
  if (!ok) failed++;
}
async function refused(what, status, f) {
  try {
    const r = await f();
    check(`${what} is refused with ${status}`, false, r);
  } catch (e) {
    check(`${what} is refused with ${status}`, e instanceof OpenAI.APIError && e.status === status &&
          typeof e.message === 'string', { status: e.status, message: e.message });
  }
}

if (mode === 'keys') {
  const c = await client.completions.create({ model, prompt: 'forty two', max_tokens: 12 });
  check('a completion with the key', c.choices[0].text === '42', c);
  const models = await client.models.list();
  check('models.list with the key', models.data.length === 1 && models.data[0].id === model, models.data);
  const other = new OpenAI({ baseURL: `${url}/v1`, apiKey: 'sk-not-a-key', maxRetries: 0, timeout: 60000 });
  try {
    const r = await other.completions.create({ model, prompt: 'forty two', max_tokens: 12 });
    check('a wrong key is refused', false, r);
  } catch (e) {
    check('a wrong key is refused as AuthenticationError (401, invalid_api_key)',
          e instanceof OpenAI.AuthenticationError && e.status === 401 && e.code === 'invalid_api_key',
          { status: e.status, code: e.code, message: e.message });
  }
} else if (mode === 'text') {
  const models = await client.models.list();
  check('models.list names the model', models.data.length === 1 && models.data[0].id === model, models.data);
  const c = await client.completions.create({ model, prompt: 'four thousand two hundred seven', max_tokens: 12 });
  check('completion', c.choices[0].text === '4207' && c.choices[0].finish_reason === 'stop' &&
        c.usage.completion_tokens > 0, c);
  const ids = await client.completions.create({ model, prompt: [39, 8, 26, 11, 27, 10, 1], max_tokens: 12 });
  check('completion from token ids', ids.choices[0].text === '42', ids.choices);
  const stream = await client.completions.create({ model, prompt: 'three hundred five', max_tokens: 12, stream: true,
                                                   stream_options: { include_usage: true } });
  let text = '', finish = null, usage = null, chunks = 0;
  for await (const ch of stream) {
    chunks++;
    if (ch.usage) usage = ch.usage;
    for (const x of ch.choices) {
      text += x.text;
      if (x.finish_reason) finish = x.finish_reason;
    }
  }
  check('streamed completion', text === '305' && finish === 'stop' && chunks >= 2 && usage?.completion_tokens > 0,
        { text, finish, chunks, usage });
  const n = await client.completions.create({ model, prompt: 'thirteen', n: 3, temperature: 0.8, seed: 5,
                                              max_tokens: 8, logprobs: 1 });
  check('n samples with logprobs', n.choices.length === 3 &&
        n.choices.every((x) => x.logprobs.token_logprobs.length > 0), n.choices);
  const beams = await client.completions.create({ model, prompt: 'thirteen', best_of: 3, n: 2, max_tokens: 8 });
  check('best_of (beam search)', beams.choices.length === 2 && beams.choices[0].text === '13', beams.choices);
  await refused('an unknown model', 404, () => client.completions.create({ model: 'gpt-nope', prompt: 'x' }));
  await refused('max_tokens too large', 400, () => client.completions.create({ model, prompt: 'x', max_tokens: 10000000 }));
  await refused('an unknown field', 400, () => client.completions.create({ model, prompt: 'x', frobnicate: 1 }));
} else {
  const file = () => fs.createReadStream(`${wavs}/number-4207.wav`);
  const j = await client.audio.transcriptions.create({ model, file: file() });
  check('transcription (json)', j.text === '4207', j);
  const t = await client.audio.transcriptions.create({ model, file: file(), response_format: 'text' });
  check('transcription (text)', typeof t === 'string' && t.trim() === '4207', t);
  const srt = await client.audio.transcriptions.create({ model, file: file(), response_format: 'srt' });
  check('transcription (srt)', /^1\n00:00:00,000 --> 00:00:0\d,\d{3}\n4207\n/.test(srt), srt);
  const vtt = await client.audio.transcriptions.create({ model, file: file(), response_format: 'vtt' });
  check('transcription (vtt)', /^WEBVTT\n\n00:00:00\.000 --> 00:00:0\d\.\d{3}\n4207\n/.test(vtt), vtt);
  const v = await client.audio.transcriptions.create({ model, file: file(), response_format: 'verbose_json',
                                                      timestamp_granularities: ['segment'] });
  check('transcription (verbose_json)', v.text !== undefined && Array.isArray(v.segments) && v.duration > 2, v);
  const l = await client.audio.transcriptions.create({ model, file: file(), language: 'en', temperature: 0 });
  check('transcription with language and temperature', l.text === '4207', l);
  const tr = await client.audio.translations.create({ model, file: file() });
  check('translation answers', typeof tr.text === 'string', tr);
  await refused('an unknown model', 404, () => client.audio.transcriptions.create({ model: 'whisper-1', file: file() }));
  await refused('a file that is no audio', 400, async () =>
    client.audio.transcriptions.create({ model, file: await toFile(Buffer.from('not audio at all'), 'x.wav') }));
}
process.exit(failed ? 1 : 0);
