//! The token loop over any [`StepModel`]: a static KV cache allocated once at
//! [L, Hkv, S, D], the prompt fed in Q-token chunks, sampling, streaming, stop conditions,
//! per-position logits and timing.
//!
//! ## Chunks and padding
//! Every model call takes exactly Q tokens at positions `start .. start + Q`, and needs
//! `start + Q <= S` and every cache row below `start` to be valid. To process the positions
//! `[done, total)` the loop calls [`next_chunk`], which picks `start = done` and pads the chunk
//! past the last known token with a pad token (the first eos id, else 0). The padding rows land
//! in the cache at positions `>= total`; no later step can see them, because a step at `start`
//! only reads rows `< start <= total`, and the step that processes position `total` rewrites
//! them first. When `done + Q` would pass S (a long context with Q > 1), the chunk slides back
//! to end exactly at S instead: it recomputes rows `[S - Q, done)` that are already in the cache
//! from the same inputs, so they come out the same, and only the logits of new positions are
//! kept. Hence any context up to S tokens fits, whatever Q is.
//!
//! A model with a prefill function ([`StepModel::prefill_len`] P) takes calls of P tokens too:
//! [`Generator::call_len`] picks P while at least two positions remain (the prompt, a chat
//! turn; the last chunk padded by the same rule) and the contract's Q for each generated
//! token. Rows a prefill chunk recomputes when it slides back are then computed by the other
//! function, which agrees with decode to fp16 rounding (`validate` checks it).
//!
//! A prefill function that returns only its last position's logits (the default,
//! `--prefill-logits last`) is called so that the prompt's last token is that position
//! ([`last_row_chunk`]): a full chunk when P tokens remain, else a chunk that slides back to
//! end on the last token (recomputing rows already cached, as above), else, when the whole
//! sequence is shorter than P, a padded chunk up to the last token, which `decode` then takes.
//! Recording every position's logits (`--logits-out`) calls `decode` for every token instead.

use std::time::{Duration, Instant};

use half::f16;

use super::sampling::{Sampler, SamplingError, SamplingParams};
use super::StepModel;

/// What to generate.
#[derive(Debug, Clone)]
pub struct GenerateOptions {
    /// Tokens to sample after the prompt; 0 processes the prompt only.
    pub max_new_tokens: usize,
    pub sampling: SamplingParams,
    /// Stop after sampling any of the contract's eos ids.
    pub stop_at_eos: bool,
    /// Keep the logits of every processed position (for `--logits-out`); [T, V] can be large.
    pub record_logits: bool,
}

impl Default for GenerateOptions {
    fn default() -> Self {
        GenerateOptions {
            max_new_tokens: 128,
            sampling: SamplingParams::greedy(),
            stop_at_eos: true,
            record_logits: false,
        }
    }
}

/// Why generation ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StopReason {
    /// Sampled this eos id (it is the last of `Generation::tokens`).
    Eos(u32),
    MaxNewTokens,
    /// Only in [`GenerateError::ContextFull`]'s partial result.
    ContextFull,
    /// The stop check ([`Generator::stop_when`]) said so after this many tokens.
    Interrupted,
}

/// Wall-clock time spent in the model and sampler, split at the first generated token.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct Timing {
    /// Prompt tokens processed (real tokens; padding is not counted).
    pub prompt_tokens: usize,
    pub prompt_time: Duration,
    /// Generated tokens fed back through the model.
    pub decode_tokens: usize,
    pub decode_time: Duration,
    pub model_calls: usize,
    /// Of `model_calls`, those through the prefill function (a multifunction package).
    pub prefill_calls: usize,
}

impl Timing {
    pub fn prompt_tokens_per_sec(&self) -> f64 {
        rate(self.prompt_tokens, self.prompt_time)
    }
    pub fn decode_tokens_per_sec(&self) -> f64 {
        rate(self.decode_tokens, self.decode_time)
    }
}

fn rate(n: usize, t: Duration) -> f64 {
    let s = t.as_secs_f64();
    if n == 0 || s == 0.0 {
        0.0
    } else {
        n as f64 / s
    }
}

/// The logits of every processed position, in order: row t predicts token t + 1.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct LogitRows {
    pub vocab_size: usize,
    /// [rows, vocab_size], row-major.
    pub data: Vec<f32>,
}

impl LogitRows {
    pub fn rows(&self) -> usize {
        self.data.len().checked_div(self.vocab_size).unwrap_or(0)
    }
    pub fn row(&self, t: usize) -> Option<&[f32]> {
        self.data
            .get(t * self.vocab_size..(t + 1) * self.vocab_size)
    }

    /// The .npy bytes (format 1.0, little-endian float32, C order, shape [rows, V]).
    pub fn to_npy(&self) -> Vec<u8> {
        npy_f32(&self.data, &[self.rows(), self.vocab_size])
    }
}

/// Serialize a float32 array as .npy version 1.0.
pub fn npy_f32(data: &[f32], shape: &[usize]) -> Vec<u8> {
    let dims: Vec<String> = shape.iter().map(|d| d.to_string()).collect();
    // A 1-tuple needs its trailing comma in Python syntax.
    let shape_text = if dims.len() == 1 {
        format!("({},)", dims[0])
    } else {
        format!("({})", dims.join(", "))
    };
    let mut header = format!("{{'descr': '<f4', 'fortran_order': False, 'shape': {shape_text}, }}");
    // Magic (6) + version (2) + header length (2) + header + '\n' is padded to 64 bytes so the
    // data is aligned for memory-mapping readers.
    let unpadded = 10 + header.len() + 1;
    header.push_str(&" ".repeat(unpadded.next_multiple_of(64) - unpadded));
    header.push('\n');
    let mut out = Vec::with_capacity(10 + header.len() + data.len() * 4);
    out.extend_from_slice(b"\x93NUMPY\x01\x00");
    // Header lengths beyond u16 need format 2.0; our headers are < 200 bytes.
    out.extend_from_slice(&(header.len() as u16).to_le_bytes());
    out.extend_from_slice(header.as_bytes());
    for v in data {
        out.extend_from_slice(&v.to_le_bytes());
    }
    out
}

/// The result of one `generate` call.
#[derive(Debug, Clone)]
pub struct Generation {
    pub prompt: Vec<u32>,
    /// Sampled tokens, in order (an eos that stopped generation included).
    pub tokens: Vec<u32>,
    pub stop: StopReason,
    /// Present when `record_logits` was set: one row per processed position, i.e. the prompt
    /// and every generated token except the last (which was never fed back).
    pub logits: Option<LogitRows>,
    pub timing: Timing,
}

impl Generation {
    /// The generated tokens without the eos that stopped generation.
    pub fn reply_tokens(&self) -> &[u32] {
        match self.stop {
            StopReason::Eos(_) => &self.tokens[..self.tokens.len().saturating_sub(1)],
            _ => &self.tokens,
        }
    }
}

#[derive(Debug, thiserror::Error)]
pub enum GenerateError {
    #[error("the model's contract is unusable: {0}")]
    BadContract(String),
    #[error("the prompt is empty: the model needs at least one token")]
    EmptyPrompt,
    #[error("prompt token {index} is id {id}, outside the vocabulary of {vocab_size}")]
    TokenOutOfRange {
        index: usize,
        id: u32,
        vocab_size: usize,
    },
    #[error(
        "the prompt has {prompt_len} tokens but the package's context holds {max_seq_len} \
         (max_sequence_length); shorten the prompt or convert with a larger --max-seq-len"
    )]
    PromptTooLong {
        prompt_len: usize,
        max_seq_len: usize,
    },
    /// Generation reached S tokens and was asked for more; what was generated is kept.
    #[error(
        "the context is full: {max_seq_len} tokens (max_sequence_length) after generating {} \
         tokens; ask for fewer --max-new-tokens or convert with a larger --max-seq-len",
        partial.tokens.len()
    )]
    ContextFull {
        max_seq_len: usize,
        partial: Box<Generation>,
    },
    #[error("the model step at position {position} failed")]
    Step {
        position: usize,
        #[source]
        source: Box<dyn std::error::Error + Send + Sync>,
    },
    #[error(
        "the model step at position {position} returned {what}: {got} values, expected {expected}"
    )]
    BadStepOutput {
        position: usize,
        what: &'static str,
        got: usize,
        expected: usize,
    },
    #[error("sampling after position {position} failed")]
    Sampling {
        position: usize,
        #[source]
        source: SamplingError,
    },
    #[error("writing the generated text failed")]
    Output(#[source] std::io::Error),
    /// The stop check ended the prompt's processing: `processed` of its positions are cached.
    #[error("interrupted after {processed} positions of the prompt")]
    Interrupted { processed: usize },
}

/// One model call: Q tokens from `start`; positions `[first_new, end)` are processed for the
/// first time (their logits are the call's rows `first_new - start .. end - start`); rows past
/// `end` are padding.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Chunk {
    pub start: usize,
    pub first_new: usize,
    pub end: usize,
}

/// The next call that processes positions from `done` on, when `total` tokens are known.
/// Requires `done < total <= s` and `1 <= q <= s` (see the module docs for the padding rule).
pub fn next_chunk(done: usize, total: usize, q: usize, s: usize) -> Chunk {
    debug_assert!(done < total && total <= s && q >= 1 && q <= s);
    let start = if done + q <= s { done } else { s - q };
    Chunk {
        start,
        first_new: done,
        end: total.min(start + q),
    }
}

/// The next prefill call over positions from `done` on when the prefill function (P tokens a
/// call) returns its last row only: a chunk whose last row is position `total - 1` whenever
/// the sequence allows, so that row's logits are the prompt's. Requires `done + 2 <= total <=
/// s` and `2 <= p <= s`. With fewer than P tokens in the whole sequence it stops one short of
/// the last token, padded, and the caller decodes that token.
pub fn last_row_chunk(done: usize, total: usize, p: usize, s: usize) -> Chunk {
    debug_assert!(done + 2 <= total && total <= s && p >= 2 && p <= s);
    if total - done >= p {
        Chunk {
            start: done,
            first_new: done,
            end: done + p,
        }
    } else if total >= p {
        Chunk {
            start: total - p,
            first_new: done,
            end: total,
        }
    } else {
        next_chunk(done, total - 1, p, s)
    }
}

/// How many leading tokens `a` and `b` share.
fn common_prefix(a: &[u32], b: &[u32]) -> usize {
    a.iter().zip(b).take_while(|(x, y)| x == y).count()
}

/// Runs a [`StepModel`] token by token with a static KV cache.
pub struct Generator<M> {
    model: M,
    s: usize,
    q: usize,
    /// Q of the model's prefill function, if it has one (see [`Generator::call_len`]).
    prefill: Option<usize>,
    /// The prefill function returns its last position's logits only.
    prefill_last_row: bool,
    /// The logits of the last position processed.
    last: Vec<f32>,
    layers_heads: usize,
    d: usize,
    v: usize,
    pad: u32,
    eos: Vec<u32>,
    /// Empty for a stateful model (`kv_cache = "state"`), which holds its cache itself.
    key_cache: Vec<f16>,
    value_cache: Vec<f16>,
    /// The model holds the cache: no host copy, no update rows to write.
    stateful: bool,
    /// A hybrid model's recurrent state after the cached tokens (empty for the others): it
    /// cannot be rolled back, so a call never recomputes a position it holds.
    recurrent: Vec<f16>,
    hybrid: bool,
    input: Vec<i32>,
    /// The tokens whose cache rows are valid, in position order (rows `[0, cached.len())`).
    cached: Vec<u32>,
    /// Asked before each model call (see [`Generator::stop_when`]).
    stop: Option<fn() -> bool>,
}

impl<M: StepModel> Generator<M> {
    /// Check the contract's dimensions and allocate both caches, once, at [L, Hkv, S, D].
    pub fn new(model: M) -> Result<Self, GenerateError> {
        let c = model.contract();
        let (s, q, l, hkv, d, v) = (
            c.max_seq_len,
            c.query_len,
            c.num_layers,
            c.num_kv_heads,
            c.head_dim,
            c.vocab_size,
        );
        if s == 0 || q == 0 || l == 0 || hkv == 0 || d == 0 || v == 0 {
            return Err(GenerateError::BadContract(format!(
                "zero dimension: S={s} Q={q} L={l} Hkv={hkv} D={d} V={v}"
            )));
        }
        if q > s {
            return Err(GenerateError::BadContract(format!(
                "query_len Q={q} exceeds max_seq_len S={s}"
            )));
        }
        let cache_len = [l, hkv, s, d]
            .iter()
            .try_fold(1usize, |a, &b| a.checked_mul(b))
            .filter(|&n| n <= isize::MAX as usize / 2)
            .ok_or_else(|| {
                GenerateError::BadContract(format!("cache [{l}, {hkv}, {s}, {d}] is too large"))
            })?;
        if let Some(&bad) = c.eos_token_ids.iter().find(|&&e| e as usize >= v) {
            return Err(GenerateError::BadContract(format!(
                "eos id {bad} is outside the vocabulary of {v}"
            )));
        }
        let eos = c.eos_token_ids.clone();
        let pad = eos.first().copied().unwrap_or(0);
        let hybrid = c.recurrent.is_some();
        let stateful = c.kv_cache == crate::mil::contract::KvCache::State;
        // A stateful hybrid package keeps its recurrent state itself, as it keeps its cache.
        let recurrent_len = if stateful { 0 } else { c.recurrent_len() };
        if recurrent_len > isize::MAX as usize / 2 {
            let shapes: Vec<_> = c
                .recurrent
                .iter()
                .flat_map(|r| r.tensors())
                .map(|t| t.shape)
                .collect();
            return Err(GenerateError::BadContract(format!(
                "recurrent state {shapes:?} is too large"
            )));
        }
        let host_cache = if stateful { 0 } else { cache_len };
        let prefill = model.prefill_len();
        let prefill_last_row = prefill.is_some() && model.prefill_last_row_only();
        if let Some(p) = prefill.filter(|&p| p == 0 || p > s) {
            return Err(GenerateError::BadContract(format!(
                "prefill length {p} is not within 1..=S={s}"
            )));
        }
        Ok(Generator {
            model,
            s,
            q,
            prefill,
            prefill_last_row,
            last: vec![0.0; v],
            layers_heads: l * hkv,
            d,
            v,
            pad,
            eos,
            key_cache: vec![f16::ZERO; host_cache],
            value_cache: vec![f16::ZERO; host_cache],
            stateful,
            recurrent: vec![f16::ZERO; recurrent_len],
            hybrid,
            input: Vec::with_capacity(q.max(prefill.unwrap_or(0))),
            cached: Vec::new(),
            stop: None,
        })
    }

    /// Ask `stop` before each model call (an interactive session's Ctrl-C): when it says
    /// true, a reply ends there ([`StopReason::Interrupted`], the tokens so far kept) and a
    /// prompt being processed ends with [`GenerateError::Interrupted`]. Either way the cache
    /// holds exactly the positions processed, as [`Generator::cached_tokens`] says.
    pub fn stop_when(&mut self, stop: Option<fn() -> bool>) {
        self.stop = stop;
    }

    fn stopped(&self) -> bool {
        self.stop.is_some_and(|f| f())
    }

    pub fn model(&self) -> &M {
        &self.model
    }
    pub fn model_mut(&mut self) -> &mut M {
        &mut self.model
    }
    pub fn into_model(self) -> M {
        self.model
    }
    /// The key cache, [L, Hkv, S, D]; rows below the last processed position are valid. Empty
    /// for a stateful model (see [`valid_rows`](Self::valid_rows)).
    pub fn key_cache(&self) -> &[f16] {
        &self.key_cache
    }
    pub fn value_cache(&self) -> &[f16] {
        &self.value_cache
    }

    /// The dimensions of the cache: [L, Hkv, S, D].
    pub fn cache_shape(&self) -> [usize; 4] {
        let hkv = self.model.contract().num_kv_heads;
        [self.layers_heads / hkv, hkv, self.s, self.d]
    }

    /// The tokens whose cache rows are valid (the position the next step starts from is their
    /// count).
    pub fn cached_tokens(&self) -> &[u32] {
        &self.cached
    }

    /// Forget the cached tokens: the next call starts at position 0.
    pub fn reset(&mut self) {
        self.cached.clear();
        self.recurrent.fill(f16::ZERO);
    }

    /// A hybrid model's recurrent state after [`cached_tokens`](Self::cached_tokens) (empty
    /// for the others).
    pub fn recurrent_state(&self) -> &[f16] {
        &self.recurrent
    }

    /// [`recurrent_state`](Self::recurrent_state), or a stateful hybrid model's, read from
    /// its states.
    pub fn recurrent_values(&self) -> Result<Vec<f16>, GenerateError> {
        if !self.stateful || self.model.contract().recurrent.is_none() {
            return Ok(self.recurrent.clone());
        }
        self.model
            .state_recurrent()
            .map_err(|e| GenerateError::Step {
                position: self.cached.len(),
                source: e.into(),
            })
    }

    /// The valid rows of both caches, `[L, Hkv, P, D]` each with P = `cached_tokens().len()`
    /// (a stateful model's are read from its state).
    pub fn valid_rows(&self) -> Result<(Vec<f16>, Vec<f16>), GenerateError> {
        let p = self.cached.len();
        if self.stateful {
            return self.model.state_rows(p).map_err(|e| GenerateError::Step {
                position: p,
                source: e.into(),
            });
        }
        let take = |cache: &[f16]| {
            let mut out = Vec::with_capacity(self.layers_heads * p * self.d);
            for lh in 0..self.layers_heads {
                let at = lh * self.s * self.d;
                out.extend_from_slice(&cache[at..at + p * self.d]);
            }
            out
        };
        Ok((take(&self.key_cache), take(&self.value_cache)))
    }

    /// Put back rows [`valid_rows`](Self::valid_rows) returned for `tokens`: the next call
    /// continues after them as if they had just been processed.
    /// A hybrid model's `recurrent` state is the one [`recurrent_state`](Self::recurrent_state)
    /// returned after those tokens (empty for the others).
    pub fn restore(
        &mut self,
        tokens: &[u32],
        keys: &[f16],
        values: &[f16],
        recurrent: &[f16],
    ) -> Result<(), GenerateError> {
        let p = tokens.len();
        let want = self.layers_heads * p * self.d;
        let held = if self.stateful {
            self.model.contract().recurrent_len()
        } else {
            self.recurrent.len()
        };
        if recurrent.len() != held {
            return Err(GenerateError::BadContract(format!(
                "restoring a recurrent state of {} values into a model whose state holds {held}",
                recurrent.len(),
            )));
        }
        if p > self.s || keys.len() != want || values.len() != want {
            return Err(GenerateError::BadContract(format!(
                "restoring {p} positions of {} key and {} value values into a cache of {} rows                  of {} values",
                keys.len(),
                values.len(),
                self.s,
                self.layers_heads * self.d
            )));
        }
        self.check_ids(tokens)?;
        if self.stateful {
            self.model
                .restore_state_rows(p, keys, values)
                .map_err(|e| GenerateError::Step {
                    position: 0,
                    source: e.into(),
                })?;
            if !recurrent.is_empty() {
                self.model
                    .restore_state_recurrent(recurrent)
                    .map_err(|e| GenerateError::Step {
                        position: 0,
                        source: e.into(),
                    })?;
            }
            self.cached = tokens.to_vec();
            return Ok(());
        }
        let block = p * self.d;
        for lh in 0..self.layers_heads {
            let dst = lh * self.s * self.d;
            self.key_cache[dst..dst + block].copy_from_slice(&keys[lh * block..(lh + 1) * block]);
            self.value_cache[dst..dst + block]
                .copy_from_slice(&values[lh * block..(lh + 1) * block]);
        }
        self.recurrent.copy_from_slice(recurrent);
        self.cached = tokens.to_vec();
        Ok(())
    }

    fn check_ids(&self, ids: &[u32]) -> Result<(), GenerateError> {
        match ids
            .iter()
            .enumerate()
            .find(|(_, &id)| id as usize >= self.v)
        {
            Some((index, &id)) => Err(GenerateError::TokenOutOfRange {
                index,
                id,
                vocab_size: self.v,
            }),
            None => Ok(()),
        }
    }

    /// Process `prompt`, then sample up to `max_new_tokens`, handing each sampled token to
    /// `on_token` as soon as it is chosen. The cache is reused: each call starts at position 0.
    pub fn generate(
        &mut self,
        prompt: &[u32],
        opts: &GenerateOptions,
        on_token: &mut dyn FnMut(u32) -> std::io::Result<()>,
    ) -> Result<Generation, GenerateError> {
        self.reset();
        self.extend(prompt, opts, on_token)
    }

    /// As [`generate`](Self::generate) for the whole sequence `prompt`, but the longest prefix
    /// of it whose rows are already in the cache (from the calls before, or
    /// [`restore`](Self::restore)) is not processed again: a chat feeds only its new turn.
    /// `Generation::timing.prompt_tokens` counts the tokens processed.
    pub fn extend(
        &mut self,
        prompt: &[u32],
        opts: &GenerateOptions,
        on_token: &mut dyn FnMut(u32) -> std::io::Result<()>,
    ) -> Result<Generation, GenerateError> {
        if prompt.is_empty() {
            return Err(GenerateError::EmptyPrompt);
        }
        self.check_ids(prompt)?;
        if prompt.len() > self.s {
            return Err(GenerateError::PromptTooLong {
                prompt_len: prompt.len(),
                max_seq_len: self.s,
            });
        }
        let mut sampler =
            Sampler::new(opts.sampling.clone()).map_err(|source| GenerateError::Sampling {
                position: 0,
                source,
            })?;
        let mut seq: Vec<u32> = prompt.to_vec();
        let mut logits = opts.record_logits.then(|| LogitRows {
            vocab_size: self.v,
            data: Vec::new(),
        });
        // At least the last prompt token is processed: its logits choose the first new token.
        let mut reused = common_prefix(&self.cached, prompt).min(prompt.len() - 1);
        // A recurrent state holds every cached token and cannot be rolled back: it is kept
        // only when the new sequence continues all of them.
        if self.hybrid && reused < self.cached.len() {
            self.reset();
            reused = 0;
        }
        self.cached.truncate(reused);
        let mut timing = Timing {
            prompt_tokens: prompt.len() - reused,
            ..Timing::default()
        };
        let mut last = std::mem::take(&mut self.last);
        last.resize(self.v, 0.0);

        let t0 = Instant::now();
        let done = self.process(&seq, reused, &mut last, logits.as_mut(), &mut timing, true);
        self.last = last;
        done?;
        timing.prompt_time = t0.elapsed();

        let t1 = Instant::now();
        let mut tokens = Vec::new();
        let mut stop = StopReason::MaxNewTokens;
        let finish = |tokens, stop, logits, mut timing: Timing| {
            timing.decode_time = t1.elapsed();
            Generation {
                prompt: prompt.to_vec(),
                tokens,
                stop,
                logits,
                timing,
            }
        };
        for n in 0..opts.max_new_tokens {
            let position = seq.len() - 1;
            let tok = sampler
                .sample(&self.last)
                .map_err(|source| GenerateError::Sampling { position, source })?;
            tokens.push(tok);
            seq.push(tok);
            on_token(tok).map_err(GenerateError::Output)?;
            if opts.stop_at_eos && self.eos.contains(&tok) {
                stop = StopReason::Eos(tok);
                break;
            }
            if n + 1 == opts.max_new_tokens {
                break;
            }
            if self.stopped() {
                stop = StopReason::Interrupted;
                break;
            }
            if seq.len() > self.s {
                let partial = finish(tokens, StopReason::ContextFull, logits, timing);
                return Err(GenerateError::ContextFull {
                    max_seq_len: self.s,
                    partial: Box::new(partial),
                });
            }
            let mut last = std::mem::take(&mut self.last);
            let position = seq.len() - 1;
            let done = self.process(
                &seq,
                position,
                &mut last,
                logits.as_mut(),
                &mut timing,
                false,
            );
            self.last = last;
            done?;
            timing.decode_tokens += 1;
        }
        Ok(finish(tokens, stop, logits, timing))
    }

    /// How many tokens the next call takes when `left` positions remain: the prefill
    /// function's Q while at least two remain (a prompt, or a chat turn; the last chunk is
    /// padded), else the contract's Q (one generated token: `decode`).
    pub fn call_len(&self, left: usize) -> usize {
        match self.prefill {
            Some(p) if left >= 2 => p,
            _ => self.q,
        }
    }

    /// The logits of the last position processed (the ones the next token is sampled from).
    pub fn last_logits(&self) -> &[f32] {
        &self.last
    }

    /// The next call over positions `[done, total)`: its Q and chunk. `recording`: every
    /// position's logits are wanted, which a last-row prefill function does not return.
    fn next_call(&self, done: usize, total: usize, recording: bool) -> (usize, Chunk) {
        let mut q = self.call_len(total - done);
        if self.hybrid {
            // Every position's logits: a last-row prefill function returns one row, decode all.
            if recording && self.prefill_last_row && q != self.q {
                q = self.q;
            }
            // Never back over rows the state holds: the chunk starts at `done` and its padding
            // may run past S (the package takes it, docs/contract.md "Hybrid packages").
            let end = total.min(done + q);
            let chunk = Chunk {
                start: done,
                first_new: done,
                end,
            };
            return (q, chunk);
        }
        match self.prefill {
            Some(p) if q == p && q != self.q && self.prefill_last_row => {
                if recording {
                    (self.q, next_chunk(done, total, self.q, self.s))
                } else {
                    (p, last_row_chunk(done, total, p, self.s))
                }
            }
            _ => (q, next_chunk(done, total, q, self.s)),
        }
    }

    /// Run the model over positions `[done, seq.len())`, writing cache rows in place and
    /// leaving the logits of the last position in `last`. `interruptible`: ask the stop check
    /// before each call (a prompt; a generated token was checked before it was fed).
    fn process(
        &mut self,
        seq: &[u32],
        mut done: usize,
        last: &mut [f32],
        mut record: Option<&mut LogitRows>,
        timing: &mut Timing,
        interruptible: bool,
    ) -> Result<(), GenerateError> {
        let total = seq.len();
        while done < total {
            if interruptible && self.stopped() {
                return Err(GenerateError::Interrupted { processed: done });
            }
            let (q, c) = self.next_call(done, total, record.is_some());
            self.input.clear();
            self.input
                .extend(seq[c.start..c.end].iter().map(|&t| t as i32));
            self.input.resize(q, self.pad as i32);
            let (keys, values) = (&self.key_cache, &self.value_cache);
            let out = if self.hybrid {
                let valid = c.end - c.start;
                let state = &self.recurrent;
                self.model
                    .step_recurrent(&self.input, valid, c.start, keys, values, state)
            } else {
                self.model.step(&self.input, c.start, keys, values)
            }
            .map_err(|e| GenerateError::Step {
                position: c.start,
                source: e.into(),
            })?;
            timing.model_calls += 1;
            if q != self.q {
                timing.prefill_calls += 1;
            }
            let rows = self.layers_heads * q * self.d;
            let check = |what, got: usize, expected| {
                if got == expected {
                    Ok(())
                } else {
                    Err(GenerateError::BadStepOutput {
                        position: c.start,
                        what,
                        got,
                        expected,
                    })
                }
            };
            // A last-row prefill call returns the row of position start + Q - 1 alone.
            let logit_rows = if q != self.q && self.prefill_last_row {
                1
            } else {
                q
            };
            check("logits", out.logits.len(), logit_rows * self.v)?;
            // A hybrid chunk's one row is its last real token's (its padding follows it).
            let first_row = match (logit_rows < q, self.hybrid) {
                (true, true) => c.end - logit_rows,
                _ => c.start + q - logit_rows,
            };
            // A stateful model wrote its rows itself and returns none.
            let rows = if self.stateful { 0 } else { rows };
            check("key_update", out.key_update.len(), rows)?;
            check("value_update", out.value_update.len(), rows)?;
            check("recurrent state", out.recurrent.len(), self.recurrent.len())?;
            // key_update[l, h] is a contiguous [Q, D] block that lands on cache rows
            // [start, start + Q) of the contiguous [S, D] block cache[l, h]; a hybrid chunk's
            // padding rows past S have no place and are dropped.
            let kept = q.min(self.s - c.start) * self.d;
            for lh in 0..self.layers_heads * usize::from(!self.stateful) {
                let dst = (lh * self.s + c.start) * self.d;
                let src = lh * q * self.d;
                self.key_cache[dst..dst + kept].copy_from_slice(&out.key_update[src..src + kept]);
                self.value_cache[dst..dst + kept]
                    .copy_from_slice(&out.value_update[src..src + kept]);
            }
            self.recurrent.copy_from_slice(&out.recurrent);
            let row = |p: usize| {
                let r = p.checked_sub(first_row).filter(|&r| r < logit_rows).ok_or(
                    GenerateError::BadStepOutput {
                        position: p,
                        what: "logits rows (none for this position)",
                        got: logit_rows,
                        expected: q,
                    },
                )?;
                Ok::<_, GenerateError>(&out.logits[r * self.v..(r + 1) * self.v])
            };
            if let Some(rec) = record.as_deref_mut() {
                for p in c.first_new..c.end {
                    rec.data.extend_from_slice(row(p)?);
                }
            }
            if c.end == total {
                last.copy_from_slice(row(total - 1)?);
            }
            self.cached.extend_from_slice(&seq[done..c.end]);
            done = c.end;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    proptest! {
        /// Walking a sequence chunk by chunk, as the prompt and decode loops do, every position
        /// is processed exactly once, calls fit in S, and no call can see a row that was never
        /// written (or was only written as padding).
        #[test]
        fn chunks_cover_every_position_once(
            s in 1usize..40,
            q_frac in 0.0f64..1.0,
            prompt_frac in 0.0f64..1.0,
        ) {
            let q = 1 + ((s - 1) as f64 * q_frac) as usize;
            let prompt = 1 + ((s - 1) as f64 * prompt_frac) as usize;
            // Which rows hold real (non-padding) values.
            let mut real = vec![false; s];
            let mut seen = Vec::new();
            let mut step = |done: usize, total: usize, real: &mut Vec<bool>| {
                let mut done = done;
                while done < total {
                    let c = next_chunk(done, total, q, s);
                    prop_assert!(c.start + q <= s);
                    prop_assert!(c.start <= done && c.first_new == done && c.end > done);
                    prop_assert!(real[..c.start].iter().all(|&r| r), "sees unwritten rows");
                    for (p, r) in real.iter_mut().enumerate().take(c.start + q).skip(c.start) {
                        *r = p < c.end;
                    }
                    seen.extend(c.first_new..c.end);
                    done = c.end;
                }
                Ok(())
            };
            step(0, prompt, &mut real)?;
            for total in prompt + 1..=s {
                step(total - 1, total, &mut real)?;
            }
            prop_assert_eq!(seen, (0..s).collect::<Vec<_>>());
        }
    }

    proptest! {
        /// A prompt (or a chat turn after cached rows) walked with a last-row prefill function
        /// of P tokens and decode for the rest: every position is processed once, no call sees
        /// a row never written, and the call that reaches the last token returns its row.
        #[test]
        fn last_row_prefill_ends_on_the_last_token(
            s in 2usize..48,
            p_frac in 0.0f64..1.0,
            cached_frac in 0.0f64..1.0,
            total_frac in 0.0f64..1.0,
        ) {
            let p = 2 + ((s - 2) as f64 * p_frac) as usize;
            let total = 1 + ((s - 1) as f64 * total_frac) as usize;
            let mut done = ((total - 1) as f64 * cached_frac) as usize;
            let mut real = vec![false; s];
            real[..done].iter_mut().for_each(|r| *r = true);
            let mut seen = Vec::new();
            while done < total {
                let (q, c) = if total - done >= 2 {
                    (p, last_row_chunk(done, total, p, s))
                } else {
                    (1, next_chunk(done, total, 1, s))
                };
                prop_assert!(c.start + q <= s);
                prop_assert!(c.start <= done && c.first_new == done && c.end > done);
                prop_assert!(real[..c.start].iter().all(|&r| r), "sees unwritten rows");
                if c.end == total {
                    prop_assert_eq!(c.start + q - 1, total - 1, "the last row is not the last token");
                }
                for (i, r) in real.iter_mut().enumerate().take(c.start + q).skip(c.start) {
                    *r = i < c.end;
                }
                seen.extend(c.first_new..c.end);
                done = c.end;
            }
            let start = seen.first().copied().unwrap_or(total);
            prop_assert_eq!(seen, (start..total).collect::<Vec<_>>());
        }
    }

    #[test]
    fn npy_header_is_aligned_and_describes_the_array() {
        let bytes = npy_f32(&[1.0, -2.5, 3.0, 0.0, 5.0, 6.0], &[2, 3]);
        assert_eq!(&bytes[..8], b"\x93NUMPY\x01\x00");
        let hlen = u16::from_le_bytes([bytes[8], bytes[9]]) as usize;
        assert_eq!((10 + hlen) % 64, 0);
        let header = std::str::from_utf8(&bytes[10..10 + hlen]).unwrap();
        assert!(header.contains("'descr': '<f4'"));
        assert!(header.contains("'shape': (2, 3)"));
        assert!(header.ends_with('\n'));
        let data: Vec<f32> = bytes[10 + hlen..]
            .chunks_exact(4)
            .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
            .collect();
        assert_eq!(data, vec![1.0, -2.5, 3.0, 0.0, 5.0, 6.0]);
        let one = npy_f32(&[1.0], &[1]);
        let hlen = u16::from_le_bytes([one[8], one[9]]) as usize;
        let header = std::str::from_utf8(&one[10..10 + hlen]).unwrap();
        assert!(header.contains("'shape': (1,)"));
    }
}
