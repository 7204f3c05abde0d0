//! The two sides of the comparison: the evaluation tokens, the package's logits over them (its
//! steps instrumented for range statistics) and the float reference's.

use half::f16;

use super::validate_error::{ValidateError, ValidateOptions};
use crate::checkpoint::Checkpoint;
use crate::mil::contract::Contract;
use crate::model::layerwise::{logits_layerwise, ReferencePath, LAYERWISE_BACKEND};
use crate::model::Reference;
use crate::progress::Progress;
use crate::runtime::chain_runner::Saved;
use crate::runtime::generate::{GenerateOptions, Generator};
use crate::runtime::interp::Stats;
use crate::runtime::{RuntimeError, StepModel, StepOutput};

/// A package (or chain) step that also collects range statistics.
struct Instrumented<'p> {
    pkg: &'p Saved,
    stats: Stats,
    progress: &'p dyn Progress,
    /// Text tokens not scored yet: each step scores up to Q of them.
    unscored: usize,
}

impl StepModel for Instrumented<'_> {
    fn contract(&self) -> &Contract {
        self.pkg.contract()
    }
    fn step(
        &mut self,
        input_ids: &[i32],
        position: usize,
        key_cache: &[f16],
        value_cache: &[f16],
    ) -> Result<StepOutput, RuntimeError> {
        let out = self.pkg.step_with_stats(
            input_ids,
            position,
            key_cache,
            value_cache,
            Some(&mut self.stats),
        )?;
        let scored = input_ids.len().min(self.unscored);
        self.unscored -= scored;
        self.progress.advance(scored as u64);
        Ok(out)
    }
    fn step_recurrent(
        &mut self,
        input_ids: &[i32],
        valid: usize,
        position: usize,
        key_cache: &[f16],
        value_cache: &[f16],
        recurrent: &[f16],
    ) -> Result<StepOutput, RuntimeError> {
        let out = self.pkg.step_full(
            input_ids,
            position,
            (key_cache, value_cache),
            Some((valid, recurrent)),
            Some(&mut self.stats),
        )?;
        let scored = valid.min(self.unscored);
        self.unscored -= scored;
        self.progress.advance(scored as u64);
        Ok(out)
    }
    fn state_rows(&self, rows: usize) -> Result<(Vec<f16>, Vec<f16>), RuntimeError> {
        self.pkg.state_rows(rows)
    }
}

/// The package's logits at every position of `tokens` (one step per token, or per Q of them),
/// and the range statistics its steps collected.
pub(super) fn score_tokens(
    package: &Saved,
    tokens: &[u32],
    progress: &dyn Progress,
) -> Result<(Vec<Vec<f32>>, Stats), ValidateError> {
    let (got, stats, _) = score_tokens_keeping(package, tokens, progress, 0)?;
    Ok((got, stats))
}

/// The keys and values of a model's first positions: [L, Hkv, P, D] each.
pub(super) type CacheRows = (Vec<f16>, Vec<f16>);

/// [`score_tokens`], also keeping the cache rows of the first `keep` positions as the
/// default function wrote them (what `prefill` must write too).
pub(super) fn score_tokens_keeping(
    package: &Saved,
    tokens: &[u32],
    progress: &dyn Progress,
    keep: usize,
) -> Result<(Vec<Vec<f32>>, Stats, CacheRows), ValidateError> {
    let mut gen = Generator::new(Instrumented {
        pkg: package,
        stats: Stats::default(),
        progress,
        unscored: tokens.len(),
    })?;
    progress.begin("score", tokens.len() as u64);
    progress.working_on("tokens through the package");
    let out = gen.generate(
        tokens,
        &GenerateOptions {
            max_new_tokens: 0,
            record_logits: true,
            ..GenerateOptions::default()
        },
        &mut |_| Ok(()),
    );
    progress.end();
    let rows = out?.logits.ok_or(ValidateError::NoLogits)?;
    let got: Vec<Vec<f32>> = (0..rows.rows())
        .filter_map(|t| rows.row(t).map(|r| r.to_vec()))
        .collect();
    let kept = match keep.min(tokens.len()) {
        0 => (Vec::new(), Vec::new()),
        keep => {
            let (k, v) = gen.valid_rows()?;
            let d = package.contract().head_dim;
            let first = |x: Vec<f16>| -> Vec<f16> {
                x.chunks_exact(tokens.len() * d)
                    .flat_map(|block| &block[..keep * d])
                    .copied()
                    .collect()
            };
            (first(k), first(v))
        }
    };
    Ok((got, gen.into_model().stats, kept))
}

/// The evaluation tokens: BOS (when the contract has one), then the text, at most
/// `max_tokens` and the package's S.
pub(super) fn text_tokens(c: &Contract, opts: &ValidateOptions) -> Result<Vec<u32>, ValidateError> {
    let mut tokens: Vec<u32> = opts.tokens.to_vec();
    if let Some(bos) = c.bos_token_id {
        tokens.insert(0, bos);
    }
    let cap = opts.max_tokens.unwrap_or(usize::MAX).min(c.max_seq_len);
    let why = if tokens.len() < 2 {
        format!(
            "the evaluation text has {} token(s) (with BOS): at least 2 are needed",
            tokens.len()
        )
    } else if cap < 2 && opts.max_tokens.is_some_and(|m| m < c.max_seq_len) {
        format!("--max-tokens {cap} leaves fewer than 2 positions to score: give at least 2",)
    } else if cap < 2 {
        format!(
            "the package holds {} position(s) (max_seq_len): at least 2 are needed to score \
             a next token",
            c.max_seq_len
        )
    } else {
        tokens.truncate(cap);
        return Ok(tokens);
    };
    Err(ValidateError::TextTooShort(why))
}

/// The float reference's logits at every position of `tokens`, and what computed them (refused
/// when they say nothing: the same value for every token at every position, or a non-finite
/// one, as a config whose constants overflow gives; a package built from it would agree): the
/// whole model in f32 (candle-transformers where it can express the checkpoint) while its f32
/// weights fit `budget`, else block by block, one block's weights alive
/// ([`logits_layerwise`]). The reference is dropped on return, before the package runs, so
/// the two peaks do not add.
pub(super) fn reference_logits(
    ckpt: &Checkpoint,
    tokens: &[u32],
    budget: u64,
    progress: &dyn Progress,
) -> Result<(String, Vec<Vec<f32>>), ValidateError> {
    match ReferencePath::choose(ckpt, budget) {
        ReferencePath::Whole => {
            let mut reference = Reference::load(ckpt)?;
            progress.begin("reference", 1);
            progress.working_on(&format!("{} tokens", tokens.len()));
            let expected = reference.logits_all(tokens);
            if expected.is_ok() {
                progress.advance(1);
            }
            progress.end();
            Ok((reference.backend().as_str().to_string(), expected?))
        }
        ReferencePath::Layerwise => {
            progress.begin("reference", ckpt.spec().num_hidden_layers as u64);
            progress.working_on(&format!("{} tokens, block by block", tokens.len()));
            let expected = logits_layerwise(ckpt, tokens, &mut |_| progress.advance(1));
            progress.end();
            Ok((LAYERWISE_BACKEND.to_string(), expected?))
        }
    }
    .and_then(|(backend, rows)| match degenerate(&rows) {
        None => Ok((backend, rows)),
        Some(what) => Err(ValidateError::DegenerateReference {
            checkpoint: ckpt.dir().to_path_buf(),
            what,
        }),
    })
}

/// What makes reference logits say nothing, if anything does.
fn degenerate(rows: &[Vec<f32>]) -> Option<&'static str> {
    let flat = |r: &Vec<f32>| r.iter().all(|&x| x == r[0]);
    if rows.iter().flatten().any(|x| !x.is_finite()) {
        Some("a non-finite logit")
    } else if !rows.is_empty() && rows.iter().all(flat) {
        Some("one value for every token")
    } else {
        None
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn logits_that_say_nothing_are_named() {
        let varied = vec![vec![0.0, 1.0], vec![2.0, 2.0]];
        assert_eq!(degenerate(&varied), None);
        let flat = vec![vec![0.0, 0.0], vec![3.0, 3.0]];
        assert_eq!(degenerate(&flat), Some("one value for every token"));
        let nan = vec![vec![0.0, f32::NAN]];
        assert_eq!(degenerate(&nan), Some("a non-finite logit"));
        let inf = vec![vec![f32::INFINITY, 1.0]];
        assert_eq!(degenerate(&inf), Some("a non-finite logit"));
    }
}
